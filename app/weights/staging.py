"""Staged weight versions (Prime-RL's ``stage``/``commit`` contract): the bytes move and are checked while the engine
generates; the pause only commits.

- **Versions.** The active version is ``"base"`` while the served weights are the model's own checkpoint (at start,
  after ``/reload_weights``; tito's own label ``default`` is accepted for it too), else tito's weight version. A delta
  must name it as ``base_version``; ``dirty`` is tito's "weights inconsistent" state. One entry per staged version
  (staging it again replaces it), at most ``--max-staged-versions`` (the oldest is dropped).
- **Stage** (any transport): a delta is read record by record (in a process of its own), checked
  against the active weights' names, shapes and dtypes (a bad one is a 400 here, never at commit) and written in
  tito's prepared form (sorted int64 indices) under the staging directory; the workers start filling their host copy
  of the active weights.
- **Commit** (under ``WeightManager``'s one-update-at-a-time rule): the workers add the delta to their copy and load
  only what changed (app/engine/worker_delta.py); a full version is a checkpoint update from its staged directory.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.core.metrics import (
    DELTA_ELEMENTS,
    STAGE_BYTES,
    STAGE_SECONDS,
    STAGE_UPLOADS,
    STAGED,
    STAGED_VERSION,
    STAGES,
)
from app.core.protocol import ApiError
from app.engine.delta_format import DeltaFormatError
from app.weights.delta_check import in_process, prepare_delta
from app.weights.stage_uploads import Uploads, background, remove_tree, safe_component, sha256_file
from app.weights.tied import check_checkpoint, tied_embedding, tied_heads
from app.weights.updates import TensorInfo, UpdateOutcome, WeightManager, scan_checkpoint

if TYPE_CHECKING:
    from app.core.settings import Settings
    from app.engine.adapter import Engine

# Runs ``work`` as the next control-plane transition (app/server/control.py ``ControlPlane.guard``).
Guard = Callable[[str, Callable[[], Awaitable[UpdateOutcome]]], Callable[[], Awaitable[UpdateOutcome]]]

log = logging.getLogger("tito.staging")

MODES = ("full", "delta")
# Seconds between looks at the workers' preparation, growing: each look is an RPC between two engine steps.
READY_POLL, READY_POLL_MAX = 0.05, 0.5
WORKER_RPC_TIMEOUT = 60.0  # the workers' quick answers (copy status, prepare, layout); the engine core may be busy
BASE = "base"

@dataclass
class Staged:
    version: str
    mode: str
    base_version: str | None
    transport: str  # path | multipart | chunked | streaming
    source: str  # the path staged, or the uploaded file's name
    artifact: Path  # the delta file, or the full checkpoint's directory
    prepared: Path | None  # delta: tito's prepared form
    owned: Path | None  # a directory of ours to remove with the entry
    sha256: str
    nbytes: int
    tensors: int = 0
    elements: int = 0
    seconds: float = 0.0
    staged_at: float = field(default_factory=time.time)
    committing: bool = False
    ready_seconds: float = 0.0  # a delta: how long the stage waited for the workers to make it ready

    def body(self) -> dict[str, Any]:
        return {"version": self.version, "mode": self.mode, "base_version": self.base_version,
                "transport": self.transport, "source": self.source, "sha256": self.sha256, "bytes": self.nbytes,
                "tensors": self.tensors, "elements": self.elements, "staged_at": self.staged_at}


class StagingManager:
    """One per server (``AppState.staging``); uses the engine, the weight manager (versions, origin, integrity) and
    the control plane's guard (a commit takes its turn like every update)."""

    def __init__(self, engine: Engine, settings: Settings, weights: WeightManager, guard: Guard) -> None:
        s = settings
        self.engine, self.settings, self.weights, self.guard = engine, settings, weights, guard
        self.root = Path(tempfile.mkdtemp(prefix="tito-staging-", dir=s.staging_dir or None))
        atexit.register(remove_tree, self.root)
        self.limit = max(1, s.max_staged_versions)
        self.uploads = Uploads(self.root / "uploads", s.max_stage_bytes, max(4, 2 * self.limit))
        self.staged: dict[str, Staged] = {}
        self.active_sha256: str | None = None
        self.last_mode: str | None = None
        self.workers: list[Any] = []  # the workers' copy status, as last reported
        self._seq = 0
        self.active_owned: Path | None = None  # a committed full version's directory: the active weights' origin

    # ------------------------------------------------------------------ versions

    @property
    def on_base(self) -> bool:
        o = self.weights.origin
        return o is not None and o.get("kind") == "base"

    @property
    def active_version(self) -> str:
        return BASE if self.on_base else self.weights.version

    def is_active(self, version: str) -> bool:
        return version == self.active_version or (self.on_base and version == self.weights.version)

    def check(self, version: str, mode: str, base: str | None) -> tuple[str, str, str | None]:
        """Prime-RL's rules for every stage route (and the commit's base): (version, mode, base_version)."""
        if mode not in MODES:
            raise ApiError(400, f"unsupported weight update mode: {mode} (full or delta).", param="mode")
        if mode == "delta":
            self.check_clean()
            if base is None:
                raise ApiError(400, "base_version is required for a delta.", param="base_version")
            if not self.is_active(base):
                raise ApiError(409, f"base_version mismatch: active={self.active_version}, got={base}.",
                               param="base_version")
            if version == base:
                raise ApiError(409, f"version {version!r} equals its base_version.", param="version")
        return version, mode, base

    def check_clean(self) -> None:
        bad = self.weights.inconsistent
        if bad is not None:
            raise ApiError(409, f"{bad.message()}; a delta needs consistent weights.")

    # ------------------------------------------------------------------ staging

    def new_dir(self, version: str) -> Path:
        self._seq += 1
        d = self.root / "versions" / f"{self._seq:05d}-{safe_component(version)}"
        d.mkdir(parents=True)
        return d

    async def _origin_tensors(self) -> tuple[dict[str, TensorInfo], list[str] | None]:
        """The active weights' tensors (names, shapes, dtypes) and the files the workers fill their copy from (None:
        their copy already holds the active version, from a delta commit)."""
        o = self.weights.origin
        if o is None:
            raise ApiError(409, "the active weights came from a broadcast or vLLM's weight transfer, and tito keeps no "
                                "copy of them: stage a full version or POST /reload_weights first.")
        if o.get("kind") == "delta":
            return o["tensors"], None
        directory = Path(o.get("dir") or self.settings.model)
        try:
            ck = await asyncio.to_thread(scan_checkpoint, directory)
        except ApiError as e:
            raise ApiError(409, f"the checkpoint the active weights were loaded from ({directory}) is no longer "
                                f"readable ({e.message}): stage a full version or POST /reload_weights first."
                           ) from None
        if o.get("fingerprint") not in (None, ck.fingerprint):
            raise ApiError(409, f"the checkpoint the active weights were loaded from ({directory}) changed on disk "
                                "since: stage a full version or POST /reload_weights first.")
        # A tied head's copy (a trainer's checkpoint holds one) is no tensor of the model (app/weights/tied.py).
        expected = await self.weights.expected()
        heads = set(tied_heads(ck.tensors, expected, tied_embedding(self.weights.model_dir, expected)))
        return {k: v for k, v in ck.tensors.items() if k not in heads}, [str(f) for f in ck.files]

    async def register(self, version: str, mode: str, base: str | None, artifact: Path, transport: str, source: str,
                       owned: Path | None, sha256: str | None = None) -> dict[str, Any]:
        """Check and stage an artifact (a delta file; a full checkpoint's directory, or its one file)."""
        if mode == "delta":
            assert base is not None
            return await self.register_delta(version, base, artifact, transport, source, owned, sha256)
        directory = artifact
        if artifact.is_file():
            # A single checkpoint file: a directory holding just it, under the name a checkpoint loader looks for.
            directory = owned or self.new_dir(version)
            target = directory / "model.safetensors"
            if target != artifact:
                if owned is not None:
                    await background(os.replace, artifact, target)  # our own upload: moved
                else:
                    target.symlink_to(artifact)  # a path the caller staged: linked, never copied
            owned = directory
        return await self.register_full(version, directory, transport, source, owned, sha256)

    async def register_delta(self, version: str, base: str, artifact: Path, transport: str, source: str,
                             owned: Path | None, sha256: str | None = None) -> dict[str, Any]:
        """Check and prepare a delta artifact; on success it is the staged ``version``."""
        self._refuse_committing(version)
        tensors, files = await self._origin_tensors()
        out_dir = owned or self.new_dir(version)
        t0 = time.monotonic()
        try:
            prepared = out_dir / "prepared.stream"
            try:
                n, elements = await in_process(prepare_delta, artifact, prepared, tensors,
                                               tied_embedding(self.weights.model_dir, tensors),
                                               timeout=self.settings.stage_timeout)
            except DeltaFormatError as e:
                raise ApiError(400, f"bad delta {source}: {e}", param="file" if transport != "path" else "path") \
                    from None
            digest = sha256 if sha256 else str(await background(sha256_file, artifact))
        except BaseException:
            remove_tree(out_dir)
            STAGES.labels(transport, "delta", "error").inc()
            raise
        dt = time.monotonic() - t0
        entry = Staged(version, "delta", base, transport, source, artifact, prepared, out_dir, digest,
                       artifact.stat().st_size, n, elements, dt)
        self._add(entry)
        STAGE_SECONDS.observe(dt)
        ready, t1 = False, time.monotonic()
        if not self.weights.busy:  # else an update (a commit) is changing the weights: it prepares them itself
            try:
                # The workers make this delta ready for its commit (CPU: its layers processed ahead of the pause)
                # while the engine generates; Prime-RL commits as soon as the stage answers, so the answer waits.
                await self._prepare_workers(self.active_version, files, {"path": str(prepared), "version": version})
                ready = await self._wait_ready(version)
            except ApiError as e:  # the version is staged all the same: the commit prepares the copy again
                log.warning("staged %s, but the workers' copy is not filling yet: %s", version, e.message)
        entry.ready_seconds = time.monotonic() - t1
        log.info("staged delta %s on %s via %s: %d tensors, %d elements, %d bytes, checked in %.3fs; %s for its commit "
                 "%.3fs later", version, base, transport, n, elements, entry.nbytes, dt,
                 "ready" if ready else "not ready", entry.ready_seconds)
        return {**self._answer(entry), "ready": ready, "ready_ms": round(entry.ready_seconds * 1000, 2)}

    async def _wait_ready(self, version: str) -> bool:
        """Until every worker has made the staged delta ready for its commit, at most ``--stage-ready-wait``
        seconds (the preparation goes on after; the commit waits for what is left). False: not ready (or failed: the
        commit then applies it the old way, under the pause)."""
        deadline = time.monotonic() + max(0.0, self.settings.stage_ready_wait)
        poll = READY_POLL
        while True:
            try:
                self.workers = await asyncio.wait_for(self.engine.delta_status(), WORKER_RPC_TIMEOUT)
            except TimeoutError:
                return False
            pending = [w.get("pending") if isinstance(w, dict) else None for w in self.workers]
            mine = [p for p in pending if isinstance(p, dict) and p.get("version") == version]
            if len(mine) < len(pending) or any(p.get("state") in ("error", "cancelled") for p in mine):
                return False  # replaced (another stage or a commit), or failed
            if all(p.get("state") == "ready" for p in mine):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(poll, max(0.0, deadline - time.monotonic())))
            poll = min(poll * 1.5, READY_POLL_MAX)

    async def register_full(self, version: str, directory: Path, transport: str, source: str,
                            owned: Path | None, sha256: str | None = None) -> dict[str, Any]:
        """A full checkpoint: its headers are checked now (names, shapes), it loads at commit."""
        self._refuse_committing(version)
        try:
            ck = await asyncio.to_thread(scan_checkpoint, directory)
            await asyncio.to_thread(check_checkpoint, ck, await self.weights.expected(), self.weights.model_dir,
                                    False)
            digest = sha256 or ck.fingerprint or ""
        except BaseException:
            if owned is not None:
                remove_tree(owned)
            STAGES.labels(transport, "full", "error").inc()
            raise
        entry = Staged(version, "full", None, transport, source, directory, None, owned, digest, ck.total_bytes,
                       len(ck.tensors))
        self._add(entry)
        log.info("staged full version %s via %s: %d tensors, %d bytes", version, transport, entry.tensors,
                 entry.nbytes)
        return self._answer(entry)

    def _answer(self, e: Staged) -> dict[str, Any]:
        STAGES.labels(e.transport, e.mode, "ok").inc()
        STAGE_BYTES.labels(e.transport).inc(e.nbytes)
        return {"status": "ok", "version": e.version, "mode": e.mode, "base_version": e.base_version,
                "path": str(e.artifact), "sha256": e.sha256, "bytes": e.nbytes, "tensors": e.tensors,
                "elements": e.elements, "ingest_ms": round(e.seconds * 1000, 2)}

    def _refuse_committing(self, version: str) -> None:
        old = self.staged.get(version)
        if old is not None and old.committing:
            raise ApiError(409, f"version {version!r} is being committed; stage it again afterwards.")

    def _add(self, entry: Staged) -> None:
        self._forget_old_origin()
        old = self.staged.pop(entry.version, None)
        if old is not None:
            self._remove(old)
        while len(self.staged) >= self.limit:
            victims = [e for e in self.staged.values() if not e.committing]
            if not victims:
                break
            oldest = min(victims, key=lambda e: e.staged_at)
            log.info("dropping staged version %s (--max-staged-versions %d)", oldest.version, self.limit)
            self._remove(self.staged.pop(oldest.version))
        self.staged[entry.version] = entry
        STAGED.set(len(self.staged))
        STAGED_VERSION.labels(entry.version, entry.mode).set(1)

    def _remove(self, e: Staged) -> None:
        try:
            STAGED_VERSION.remove(e.version, e.mode)
        except KeyError:
            pass
        if e.owned is not None:
            remove_tree(e.owned)

    async def _prepare_workers(self, version: str, files: list[str] | None,
                               delta: dict[str, str] | None = None) -> list[Any]:
        """Have the workers' host copy hold ``version`` (filled in the background while generation goes on), and
        ``delta`` ({"path", "version"}) made ready for its commit on top of it."""
        try:  # answers at once (the copy fills in a worker thread): a bounded wait
            copy_dir = str(self.root / "copies") if self.settings.delta_copy == "file" else None
            self.workers = await asyncio.wait_for(self.engine.delta_prepare(version, files, delta, copy_dir),
                                                  WORKER_RPC_TIMEOUT)
        except TimeoutError:
            raise ApiError(504, f"the workers did not answer within {WORKER_RPC_TIMEOUT:g}s (preparing their copy "
                                f"of version {version}); nothing was changed, retry.") from None
        return self.workers

    # ------------------------------------------------------------------ commit

    def lookup(self, version: str, mode: str | None) -> Staged | None:
        """The staged entry to commit, or None when ``version`` is already active (a no-op). 404/409 per the
        contract."""
        if mode is not None and mode not in MODES:
            raise ApiError(400, f"unsupported weight update mode: {mode} (full or delta).", param="mode")
        entry = self.staged.get(version)
        if (mode or (entry.mode if entry else None)) == "delta":
            self.check_clean()
        if self.weights.inconsistent is None and self.is_active(version):
            return None
        if entry is None:
            raise ApiError(404, f"version {version!r} is not staged.", param="version")
        if mode is not None and mode != entry.mode:
            raise ApiError(409, f"version {version!r} was staged as {entry.mode}, not {mode}.", param="mode")
        if entry.mode == "delta" and not self.is_active(entry.base_version or ""):
            raise ApiError(409, f"base_version mismatch: active={self.active_version}, staged on "
                                f"{entry.base_version}.", param="version")
        return entry

    async def commit_delta(self, entry: Staged) -> tuple[UpdateOutcome, dict[str, Any]]:
        """Apply a staged delta; also returns how the slowest worker spent the commit (the copy, in place, reload)."""
        mgr = self.weights
        results: list[Any] = []

        async def work() -> UpdateOutcome:
            if not self.is_active(entry.base_version or "") or entry.prepared is None:
                raise ApiError(409, f"base_version mismatch: active={self.active_version}, staged on "
                                    f"{entry.base_version}.")
            tensors, files = await self._origin_tensors()
            base = self.active_version
            status = await self._prepare_workers(base, files)
            missing = [s for s in status if not isinstance(s, dict) or s.get("state") in ("missing", "error")]
            if missing:
                raise ApiError(409, f"the workers hold no copy of version {base} ({missing[0]}); stage the delta "
                                    "again.")
            prepared = str(entry.prepared)

            async def load() -> list[Any]:
                # A timeout raises TimeoutError: 504, and the weights count as inconsistent (the workers may have
                # changed some of them), as for any apply that fails halfway.
                results.extend(await asyncio.wait_for(self.engine.delta_commit(prepared, base, entry.version),
                                                      self.settings.stage_timeout))
                return results

            # The artifact and its base: for the weight record (app/weights/record.py), which keeps a copy.
            origin = {"kind": "delta", "version": entry.version, "tensors": tensors, "artifact": str(entry.artifact),
                      "base_version": base, "sha256": entry.sha256}
            return await mgr.apply("delta", load, entry.version, entry.nbytes, f"committing delta {entry.version}",
                                   origin)

        entry.committing = True
        try:
            out = await mgr.run(f"commit:{entry.version}:{entry.sha256}",
                                self.guard(f"commit {entry.version} (delta)", work), entry.version)
        finally:
            entry.committing = False
        if not out.noop:
            DELTA_ELEMENTS.inc(entry.elements)
        self.committed(entry)
        keys = ("copy_seconds", "inplace_seconds", "swap_seconds", "reload_seconds", "retie_seconds", "cpu_seconds",
                "inplace", "prebuilt", "reloaded_groups", "reloaded_tensors", "elements", "prepare_seconds")
        rows = [r for r in results if isinstance(r, dict)]
        if not rows:
            return out, {}
        stats = {k: max(r.get(k, 0) for r in rows) for k in keys}
        return out, {**stats, "prepared": all(r.get("prepared") for r in rows)}

    def committed(self, entry: Staged) -> None:
        """After a successful commit: remember what is active, drop every staged version (its own included; the
        full version's directory stays while it is the active weights' origin)."""
        self.active_sha256, self.last_mode = entry.sha256, entry.mode
        self.staged.pop(entry.version, None)
        try:
            STAGED_VERSION.remove(entry.version, entry.mode)
        except KeyError:
            pass
        for e in list(self.staged.values()):
            if not e.committing:
                self.staged.pop(e.version, None)
                self._remove(e)
        if entry.mode == "full":
            self._forget_old_origin()
            self.active_owned = entry.owned
        else:
            self._remove(entry)
        STAGED.set(len(self.staged))

    def _forget_old_origin(self) -> None:
        """Remove a committed full version's directory once the active weights no longer come from it."""
        o = self.weights.origin or {}
        if self.active_owned is not None and not str(o.get("dir", "")).startswith(str(self.active_owned)):
            remove_tree(self.active_owned)
            self.active_owned = None

    # ------------------------------------------------------------------ reporting

    def count_uploads(self) -> None:
        """The uploads-in-progress gauge, after an upload changed."""
        STAGE_UPLOADS.set(sum(u.result is None for u in self.uploads.active.values()))

    def info(self) -> dict[str, Any]:
        self.count_uploads()
        return {"active_version": self.active_version, "active_sha256": self.active_sha256,
                "dirty": self.weights.inconsistent is not None, "directory": str(self.root),
                "staged": [e.body() for e in sorted(self.staged.values(), key=lambda e: e.staged_at)],
                "uploads_in_progress": sum(u.result is None for u in self.uploads.active.values()),
                "max_staged_versions": self.limit, "max_stage_bytes": self.uploads.max_bytes,
                "workers": self.workers}
