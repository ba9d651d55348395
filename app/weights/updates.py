"""Weight updates: checkpoint validation (headers only, before anything touches the model), version labels, and the
serialized, idempotent, cancellation-safe update orchestration behind ``/update_weights`` and ``/reload_weights``.

The engine is reached only through ``app.engine.adapter.Engine``; the worker-side code is ``app.engine.worker``.
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

from app.core import metrics
from app.core.protocol import ApiError
from app.engine.weight_markers import BUFFER_SUFFIXES, CLIENT_ERROR, TIMEOUT_ERROR, UNTOUCHED
from app.weights.reload_log import log_kept, reload_seconds
from app.weights.safetensors_meta import HeaderError, read_tensors

if TYPE_CHECKING:
    from app.engine.adapter import Engine
    from app.weights.record import WeightRecord

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
    skipped: list[str] = field(default_factory=list)  # buffers and a tied head's checked copy (app/weights/tied.py)
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
             expected: dict[str, TensorInfo], what: str = "checkpoint", tied: list[str] | None = None) -> Validation:
    """Check names and shapes against the served model's own checkpoint (a 400 naming the problem); ``tied``: a tied
    head's copies, checked equal to the embedding (app/weights/tied.py), skipped."""
    v = Validation()
    unknown: list[str] = []
    for name in found:
        if name not in expected:
            (v.skipped if is_buffer(name) or name in (tied or ()) else unknown).append(name)
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
    msg = str(e).replace(UNTOUCHED, "")
    if CLIENT_ERROR in msg:
        return ApiError(400, msg.split(CLIENT_ERROR, 1)[1])
    if TIMEOUT_ERROR in msg:
        return ApiError(504, msg.split(TIMEOUT_ERROR, 1)[1])
    if isinstance(e, TimeoutError):
        return ApiError(504, f"{what} timed out.")
    log.error("%s failed: %s", what, msg)
    return ApiError(500, f"{what} failed: {msg}")


async def shielded_call(aw: Awaitable[Any], what: str, check_engine: Callable[[], None]) -> Any:
    """An engine call shielded from cancellation (the workers finish what they started), failures mapped."""
    task = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(task)
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001
        check_engine()
        raise worker_error(e, what) from None


# ------------------------------------------------------------------------------------------------ orchestration


@dataclass
class UpdateOutcome:
    version: str
    source: str
    seconds: float
    bytes: int
    noop: bool = False
    reload_seconds: float | None = None  # vLLM's own in-place reload inside the slowest worker (the rest is tito's)
    retie_seconds: float | None = None  # of tito's part: a tied head re-processed (app/engine/worker.py)
    skipped: list[str] = field(default_factory=list)  # names not loaded: buffers, a tied head's checked copy

    def body(self) -> dict[str, Any]:
        out = {"status": "ok", "weight_version": self.version, "source": self.source, "noop": self.noop,
               "seconds": round(self.seconds, 4), "bytes": self.bytes,
               **({"skipped": sorted(self.skipped)} if self.skipped else {})}
        if self.reload_seconds is not None:
            out["reload_seconds"] = round(self.reload_seconds, 4)
        if self.retie_seconds:
            out["retie_seconds"] = round(self.retie_seconds, 4)
        return out


@dataclass(frozen=True)
class Inconsistent:
    """Why the served weights are a mix of versions: an update failed after the model had started to change."""

    cause: str
    source: str  # disk | reload | broadcast | native
    since: float  # epoch seconds
    resume_on_recovery: bool  # the failed update paused the engine itself: the update that repairs it resumes

    def message(self) -> str:
        return (f"weights are inconsistent after a failed update ({self.cause}); POST /update_weights or "
                "/reload_weights")

    def body(self) -> dict[str, Any]:
        return {"cause": self.cause, "source": self.source, "since": self.since}


class WeightManager:
    """Serializes weight updates and holds the served weight version; one per server, on ``AppState.weights``.

    An update runs as its own task: a client that disconnects or times out cancels only its wait, never the load,
    and its retry (same key) joins the running task or sees the finished outcome instead of starting a second load.

    Integrity: a load that fails after the model has started to change sets ``inconsistent``. The server then stays
    paused (it never resumes by itself), aborts the requests it holds, and refuses new work until an update succeeds.
    """

    def __init__(self, engine: Engine, model_dir: str, *, abort: Callable[[], Awaitable[int]],
                 check_engine: Callable[[], None]) -> None:
        """``abort()`` aborts every in-flight request (returns how many); ``check_engine()`` raises 503 when the
        engine is dead."""
        self.engine = engine
        self.model_dir = model_dir
        self._abort = abort
        self._check_engine = check_engine
        self.version = "default"  # the weight version being served
        self.lock = asyncio.Lock()
        self.counter = 0
        self.current_key: str | None = None
        self.current: asyncio.Task[UpdateOutcome] | None = None
        self.last_key: str | None = None
        self.last_outcome: UpdateOutcome | None = None
        self.broadcaster: dict[str, Any] | None = None
        self.inconsistent: Inconsistent | None = None
        # The caller's pause asked to keep the prefix cache (``clear_cache=false``, Prime-RL's pause): an update under
        # it keeps the cache too (``_after_load``).
        self.keep_cache = False
        # vLLM's native transfer: an update open from /start_weight_update until /finish_weight_update.
        self.native_since: float | None = None
        self._native_done = asyncio.Event()
        self._native_done.set()
        self._expected: dict[str, TensorInfo] | None = None
        # Where the served weights came from: {"kind": "base"} (the model's own checkpoint), a checkpoint's files,
        # a delta commit, or None (a broadcast or native transfer: no copy on disk). Staged deltas need it.
        self.origin: dict[str, Any] | None = {"kind": "base"}
        # What a restart comes back to (app/weights/record.py); None: no record (``--state-dir off``).
        self.recorder: WeightRecord | None = None

    async def expected(self) -> dict[str, TensorInfo]:
        """The served model's own tensors (names, shapes, dtypes), read once from its checkpoint headers."""
        if self._expected is None:
            ck = await asyncio.to_thread(scan_checkpoint, Path(self.model_dir))
            self._expected = ck.tensors
        return self._expected

    @property
    def busy(self) -> bool:
        return (self.current is not None and not self.current.done()) or self.native_since is not None

    def _refuse_if_busy(self) -> None:
        if self.native_since is not None:
            raise ApiError(409, "a native weight update (/start_weight_update) is open; retry after "
                                "/finish_weight_update.")
        if self.busy or self.lock.locked():
            raise ApiError(409, f"another weight update ({self.current_key or 'in progress'}) is running; "
                                "retry when it has finished.")

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no update runs (a native one: until it is finished); False on timeout."""
        async def idle() -> None:
            while self.busy:
                if self.current is not None and not self.current.done():
                    await asyncio.gather(self.current, return_exceptions=True)
                else:
                    await self._native_done.wait()

        try:
            await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(idle())), timeout)
            return True
        except TimeoutError:
            return False

    # ------------------------------------------------------------------ integrity

    async def mark_inconsistent(self, source: str, cause: str, resume_on_recovery: bool) -> None:
        """Record a failed update that changed the model; abort what the paused engine holds (frozen ``keep``
        requests and requests queued during the pause end with ``finish_reason: "abort"``)."""
        first = self.inconsistent
        self.inconsistent = Inconsistent(cause, source, time.time(),
                                         resume_on_recovery or bool(first and first.resume_on_recovery))
        metrics.WEIGHTS_INCONSISTENT.set(1)
        log.error("weights are INCONSISTENT after a failed %s update: %s; generation stays paused until "
                  "/update_weights or /reload_weights succeeds", source, cause)
        try:
            n = await asyncio.wait_for(self._abort(), 30.0)
            if n:
                log.warning("aborted %d request(s) held by the paused engine (weights inconsistent)", n)
        except Exception as e:  # noqa: BLE001 - the state is recorded either way
            log.error("could not abort held requests: %s", e)

    def check_consistent(self) -> None:
        """Gate for new generate requests and /resume."""
        if self.inconsistent is not None:
            raise ApiError(503, self.inconsistent.message(), headers={"Retry-After": "5"})

    async def _recovered(self) -> None:
        bad_state = self.inconsistent
        if bad_state is None:
            return
        self.inconsistent = None
        metrics.WEIGHTS_INCONSISTENT.set(0)
        log.info("weights are consistent again (the failed %s update is superseded)", bad_state.source)
        if bad_state.resume_on_recovery:
            # The failed update had paused the engine itself; nobody else will resume it.
            await self.engine.resume()

    # ------------------------------------------------------------------ disk and broadcast updates

    async def run(self, key: str | None, work: Callable[[], Awaitable[UpdateOutcome]],
                  version: str | None = None) -> UpdateOutcome:
        """Run ``work`` as the one update in progress, shielded from the caller's cancellation.

        Same key as the running update → wait for it. Same key and version as the last applied one → no-op
        (unless the weights are inconsistent: then it is a real update). A different update while one runs → 409.
        """
        if key is not None and self.current is not None and not self.current.done() and key == self.current_key:
            return await asyncio.shield(self.current)
        if key is not None and key == self.last_key and self.last_outcome is not None and \
                self.inconsistent is None and (version is None or version == self.last_outcome.version):
            o = self.last_outcome
            log.info("weight update %s already applied (version %s): no-op", key, o.version)
            return UpdateOutcome(o.version, o.source, 0.0, 0, noop=True)
        self._refuse_if_busy()
        task = asyncio.ensure_future(self._locked(key, work))
        self.current, self.current_key = task, key
        return await asyncio.shield(task)

    async def _locked(self, key: str | None, work: Callable[[], Awaitable[UpdateOutcome]]) -> UpdateOutcome:
        async with self.lock:
            outcome = await work()
            self.last_key, self.last_outcome = key, outcome
            return outcome

    async def apply(self, source: str, load: Callable[[], Awaitable[list[Any] | None]], version: str, nbytes: int,
                    what: str = "loading weights", origin: dict[str, Any] | None = None) -> UpdateOutcome:
        """Pause (``wait``) unless already paused, load, set the version, reset the prefix cache, resume.

        ``load`` raises the engine's own exception; a failure whose message lacks ``UNTOUCHED`` may have changed
        the model, so it marks the weights inconsistent and the engine stays paused.
        """
        eng = self.engine
        t0 = time.monotonic()
        paused_here = False
        touched = False
        try:
            if not await eng.is_paused():
                # In-flight requests finish on the old weights; new ones queue until resume.
                await eng.pause(mode="wait", clear_cache=False, settle=False)
                paused_here = True
            try:
                results = await load()
            except ApiError:
                raise
            except Exception as e:  # noqa: BLE001
                touched = UNTOUCHED not in str(e)
                err = worker_error(e, what)
                if touched:
                    cause = err.message if err.message.startswith(what) else f"{what}: {err.message}"
                    await self.mark_inconsistent(source, cause, paused_here)
                self._check_engine()
                raise err from None
            touched = True
            engine_s = reload_seconds(results)
            retie_s = reload_seconds(results, "retie_seconds")
            log_kept(results)
            await eng.set_weight_version(version)
            self.version = version
            self.origin = origin
            if self.recorder is not None:  # before generation resumes on these weights
                self.recorder.committed(version, origin, source)
            await self._after_load(paused_here)
            await self._recovered()
        except BaseException as e:
            metrics.WEIGHT_UPDATES.labels(source, "error").inc()
            if touched and self.inconsistent is None and not isinstance(e, asyncio.CancelledError):
                await self.mark_inconsistent(source, f"after loading: {e}", paused_here)
            raise
        finally:
            if paused_here and self.inconsistent is None:
                await eng.resume()
        dt = time.monotonic() - t0
        metrics.WEIGHT_UPDATES.labels(source, "ok").inc()
        metrics.WEIGHT_UPDATE_SECONDS.labels(source).observe(dt)
        metrics.WEIGHT_VERSION.info({"version": version})
        log.info("weights updated from %s: version=%s, %d bytes in %.3fs%s", source, version, nbytes, dt,
                 f" (vLLM's reload {engine_s:.3f}s, tito {dt - engine_s:.3f}s"
                 f"{f' of which the tied head {retie_s:.3f}s' if retie_s else ''})" if engine_s is not None else "")
        return UpdateOutcome(version, source, dt, nbytes, reload_seconds=engine_s, retie_seconds=retie_s)

    # ------------------------------------------------------------------ vLLM's native transfer

    async def native(self, step: str, call: Callable[[], Awaitable[Any]], version: str | None = None) -> Any:
        """One step of vLLM's native transfer (start | update | finish), under the same rules as the other updates.

        ``start`` opens an update that holds off every other update (409) and /resume until ``finish``. An
        ``update`` outside an open one is an update of its own. A failure at any step marks the weights
        inconsistent (vLLM's workers may have changed the model) and closes the open update.
        """
        if step == "start":
            self._refuse_if_busy()
        elif step == "finish" and self.native_since is None:
            raise ApiError(409, "no native weight update is open: call /start_weight_update first.")
        elif self.lock.locked() or (self.current is not None and not self.current.done()):
            raise ApiError(409, "another weight update step is running; retry when it has finished.")
        if step == "start":
            self.native_since = time.time()
            self._native_done.clear()
        task = asyncio.ensure_future(self._native_locked(step, call, version))
        return await asyncio.shield(task)

    async def _native_locked(self, step: str, call: Callable[[], Awaitable[Any]], version: str | None) -> Any:
        async with self.lock:
            try:
                out = await call()
            except BaseException as e:
                self._close_native()
                metrics.WEIGHT_UPDATES.labels("native", "error").inc()
                if isinstance(e, ApiError) and step == "start":
                    raise
                err = e if isinstance(e, ApiError) else worker_error(e, f"{step}_weight_update")
                await self.mark_inconsistent("native", f"{step}_weight_update: {err.message}", False)
                raise err from None
            if step == "finish" or (step == "update" and self.native_since is None):
                self._close_native()
                self.origin = None
                if version is not None:
                    self.version = version
                    metrics.WEIGHT_VERSION.info({"version": version})
                if self.recorder is not None:
                    self.recorder.committed(self.version, None, "native")
                await self._after_load(False)
                await self._recovered()
                metrics.WEIGHT_UPDATES.labels("native", "ok").inc()
            return out

    async def _after_load(self, paused_here: bool) -> None:
        """The prefix cache after new weights: reset (kept requests are preempted and recompute their KV on the new
        weights, no old KV is reused) unless the caller paused asking to keep it; then, as vLLM and Prime-RL's server
        do, kept requests go on with their KV and the caller's per-version ``cache_salt`` keeps versions apart."""
        if self.keep_cache and not paused_here:
            self.engine.kept_cache_across_update()
            log.info("prefix cache kept across the update (the caller's pause asked clear_cache=false); requests "
                     "without a cache_salt are salted with the new weights' (%s)", self.engine.cache_epoch)
        elif not await self.engine.reset_prefix_cache(reset_running_requests=True):
            log.warning("prefix cache could not be fully reset after the weight update")

    def relabel(self, version: str) -> None:
        """A new label for the weights being served (``/update_weight_version``)."""
        self.version = version
        if self.recorder is not None:
            self.recorder.relabel(version)

    def _close_native(self) -> None:
        self.native_since = None
        self._native_done.set()
