"""Weight updates: checkpoint validation (headers only, before anything touches the model), version labels, and the
serialized, idempotent, cancellation-safe update orchestration behind ``/update_weights`` and ``/reload_weights``.

The engine is reached only through ``app.engine.Engine``; the worker-side code is ``app.worker_ext``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app import metrics
from app.protocol import ApiError
from app.safetensors_meta import HeaderError, read_tensors
from app.weight_markers import BUFFER_SUFFIXES, CLIENT_ERROR, TIMEOUT_ERROR

if TYPE_CHECKING:
    from app.state import AppState

log = logging.getLogger("tito.weights")

INDEX_NAME = "model.safetensors.index.json"
_STEP_RE = re.compile(r"^step[_-]?(\d+)$")


def is_buffer(name: str) -> bool:
    return name.endswith(BUFFER_SUFFIXES)


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype tag: F32, BF16, ...
    file: str


@dataclass
class Checkpoint:
    """What a checkpoint directory holds, read from the safetensors headers only."""

    directory: Path
    files: list[Path]
    tensors: dict[str, TensorInfo]
    total_bytes: int
    fingerprint: str  # changes when any file is rewritten: a rewrite of the same step is a new update

    def spec(self) -> dict[str, list[int]]:
        return {k: list(v.shape) for k, v in self.tensors.items()}


@dataclass
class Validation:
    skipped: list[str] = field(default_factory=list)  # buffers present in the checkpoint, not loaded
    cast: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (checkpoint dtype, model dtype)


def bad(message: str, status: int = 400) -> ApiError:
    return ApiError(status, message, param="weight_dir")


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check it against the file's size (truncation, overlapping data)."""
    try:
        return {k: TensorInfo(t.shape, t.dtype, path.name) for k, t in read_tensors(path).items()}
    except HeaderError as e:
        raise bad(str(e)) from None


def checkpoint_files(directory: Path) -> list[Path]:
    """The files a load reads: the index's shards if there is an index, else every ``*.safetensors``."""
    index = directory / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise bad(f"{INDEX_NAME} in {directory} is corrupt (no readable weight_map).") from None
        if not names:
            raise bad(f"{INDEX_NAME} in {directory} lists no shards.")
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise bad(f"checkpoint {directory} is missing shard(s) named in {INDEX_NAME}: {', '.join(missing)}.")
        return [directory / n for n in names]
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        raise bad(f"no safetensors files (model.safetensors or shards with {INDEX_NAME}) in {directory}.")
    return files


def scan_checkpoint(directory: Path) -> Checkpoint:
    """Read every header of the checkpoint in ``directory``. Blocking (file I/O): run in a thread."""
    if not directory.exists():
        raise bad(f"weight_dir {str(directory)!r} does not exist.", 404)
    if not directory.is_dir():
        raise bad(f"weight_dir {str(directory)!r} is not a directory.")
    files = checkpoint_files(directory)
    tensors: dict[str, TensorInfo] = {}
    total = 0
    stamp = []
    for f in files:
        for name, info in read_header(f).items():
            if name in tensors:
                raise bad(f"tensor {name!r} appears in both {tensors[name].file} and {f.name}.")
            tensors[name] = info
        st = f.stat()
        total += st.st_size
        stamp.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    index = directory / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        for name, fname in weight_map.items():
            held = tensors.get(name)
            if held is None or held.file != fname:
                raise bad(f"{INDEX_NAME} puts tensor {name!r} in {fname}, which does not hold it.")
    return Checkpoint(directory, files, tensors, total, "|".join(stamp))


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def validate(found: dict[str, tuple[int, ...]], found_dtypes: dict[str, str] | None,
             expected: dict[str, TensorInfo], what: str = "checkpoint") -> Validation:
    """Check tensor names and shapes against the served model's own checkpoint; raise a 400 naming the problem."""
    v = Validation()
    unknown: list[str] = []
    for name in found:
        if name not in expected:
            (v.skipped if is_buffer(name) else unknown).append(name)
    if unknown:
        raise bad(f"{what} has {len(unknown)} tensor(s) the model lacks: {_names(unknown)}.")
    missing = [n for n in expected if n not in found]
    if missing:
        raise bad(f"{what} is missing {len(missing)} tensor(s) of the model: {_names(missing)}.")
    for name, shape in found.items():
        want = expected.get(name)
        if want is None:
            continue
        if tuple(shape) != want.shape:
            raise bad(f"shape mismatch for {name!r}: {what} has {list(shape)}, the model expects "
                      f"{list(want.shape)}.")
        if found_dtypes is not None and found_dtypes[name] != want.dtype:
            v.cast[name] = (found_dtypes[name], want.dtype)
    return v


def derive_version(explicit: str | None, weight_dir: Path | None, counter: int) -> str:
    """Explicit label, else ``step_N`` from a ``step_N`` directory name, else ``update_<counter>``."""
    if explicit:
        return explicit
    if weight_dir is not None:
        m = _STEP_RE.match(weight_dir.name)
        if m:
            return f"step_{int(m.group(1))}"
    return f"update_{counter}"


def worker_error(e: BaseException, what: str) -> ApiError:
    """Map an engine/worker failure to an answer: the caller's fault → 400, a timeout → 504, else 500."""
    msg = str(e)
    if CLIENT_ERROR in msg:
        return ApiError(400, msg.split(CLIENT_ERROR, 1)[1])
    if TIMEOUT_ERROR in msg:
        return ApiError(504, msg.split(TIMEOUT_ERROR, 1)[1])
    if isinstance(e, TimeoutError):
        return ApiError(504, f"{what} timed out.")
    log.error("%s failed: %s", what, msg)
    return ApiError(500, f"{what} failed: {msg}")


# ------------------------------------------------------------------------------------------------ orchestration


@dataclass
class UpdateOutcome:
    version: str
    source: str
    seconds: float
    bytes: int
    noop: bool = False

    def body(self) -> dict[str, Any]:
        return {"status": "ok", "weight_version": self.version, "source": self.source, "noop": self.noop,
                "seconds": round(self.seconds, 4), "bytes": self.bytes}


class WeightManager:
    """Serializes weight updates; one per server, on ``AppState.weights``.

    An update runs as its own task: a client that disconnects or times out cancels only its wait, never the load,
    and its retry (same key) joins the running task or sees the finished outcome instead of starting a second load.
    """

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.lock = asyncio.Lock()
        self.counter = 0
        self.current_key: str | None = None
        self.current: asyncio.Task[UpdateOutcome] | None = None
        self.last_key: str | None = None
        self.last_outcome: UpdateOutcome | None = None
        self.broadcaster: dict[str, Any] | None = None
        self._expected: dict[str, TensorInfo] | None = None

    async def expected(self) -> dict[str, TensorInfo]:
        """The served model's own tensors (names, shapes, dtypes), read once from its checkpoint headers."""
        if self._expected is None:
            ck = await asyncio.to_thread(scan_checkpoint, Path(self.state.settings.model))
            self._expected = ck.tensors
        return self._expected

    @property
    def busy(self) -> bool:
        return self.current is not None and not self.current.done()

    async def run(self, key: str | None, work: Callable[[], Awaitable[UpdateOutcome]],
                  version: str | None = None) -> UpdateOutcome:
        """Run ``work`` as the one update in progress, shielded from the caller's cancellation.

        Same key as the running update → wait for it. Same key and version as the last applied one → no-op.
        A different update while one runs → 409.
        """
        if key is not None and self.busy and key == self.current_key:
            assert self.current is not None
            return await asyncio.shield(self.current)
        if key is not None and key == self.last_key and self.last_outcome is not None and \
                (version is None or version == self.last_outcome.version):
            o = self.last_outcome
            log.info("weight update %s already applied (version %s): no-op", key, o.version)
            return UpdateOutcome(o.version, o.source, 0.0, 0, noop=True)
        if self.busy or self.lock.locked():
            raise ApiError(409, f"another weight update ({self.current_key or 'in progress'}) is running; "
                                "retry when it has finished.")
        task = asyncio.ensure_future(self._locked(key, work))
        self.current, self.current_key = task, key
        return await asyncio.shield(task)

    async def _locked(self, key: str | None, work: Callable[[], Awaitable[UpdateOutcome]]) -> UpdateOutcome:
        async with self.lock:
            outcome = await work()
            self.last_key, self.last_outcome = key, outcome
            return outcome

    async def apply(self, source: str, load: Callable[[], Awaitable[None]], version: str, nbytes: int) -> UpdateOutcome:
        """Pause (``wait``) unless already paused, load, set the version, reset the prefix cache, resume."""
        eng = self.state.engine
        t0 = time.monotonic()
        paused_here = False
        try:
            if not await eng.is_paused():
                # In-flight requests finish on the old weights; new ones queue until resume.
                await eng.pause(mode="wait", clear_cache=False)
                paused_here = True
            await load()
            await eng.set_weight_version(version)
            self.state.weight_version = version
            # Kept (paused) requests are preempted and recompute their KV on the new weights; no old KV is reused.
            if not await eng.reset_prefix_cache(reset_running_requests=True):
                log.warning("prefix cache could not be fully reset after the weight update")
        except BaseException:
            metrics.WEIGHT_UPDATES.labels(source, "error").inc()
            raise
        finally:
            if paused_here:
                await eng.resume()
        dt = time.monotonic() - t0
        metrics.WEIGHT_UPDATES.labels(source, "ok").inc()
        metrics.WEIGHT_UPDATE_SECONDS.labels(source).observe(dt)
        metrics.WEIGHT_VERSION.info({"version": version})
        log.info("weights updated from %s: version=%s, %d bytes in %.3fs", source, version, nbytes, dt)
        return UpdateOutcome(version, source, dt, nbytes)
