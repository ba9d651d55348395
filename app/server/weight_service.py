"""Weight updates as every transport asks for them: Prime-RL's (from a checkpoint directory, a trainer broadcast, a
staged version's commit), ``/reload_weights``, and vLLM's native weight-transfer calls and version label. HTTP
(routers/weights.py, routers/staging.py) and gRPC (app/grpc/vllm_control.py) parse their requests and call these; the
rules (one update at a time, idempotent retries, the control plane's order) live in ``app.weights``.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from app.core import metrics
from app.core.protocol import ApiError
from app.engine.engine_setup import on_cpu
from app.server.state import AppState
from app.weights.paths import resolve_allowed
from app.weights.tied import check_checkpoint, tied_embedding
from app.weights.updates import UpdateOutcome, derive_version, is_buffer, scan_checkpoint, shielded_call

log = logging.getLogger("tito.weights")


async def engine_call(state: AppState, aw: Any, what: str) -> Any:
    """An engine utility call shielded from request cancellation; failures become a clear answer."""
    return await shielded_call(aw, what, state.check_engine)


# ------------------------------------------------------------------------------------------ Prime-RL / from disk


async def update_from_dir(state: AppState, weight_dir: str | None, version: str | None,
                          timeout: float | None) -> UpdateOutcome:
    """Prime-RL's ``/update_weights``: a checkpoint directory, or (no checkpoint files in it, a broadcaster joined)
    the trainer's broadcast of that step."""
    state.check_engine()
    directory = resolve_allowed(state.settings, weight_dir, "weight_dir") if weight_dir else None
    if directory is not None and not directory.exists():
        raise ApiError(404, f"weight_dir {weight_dir!r} does not exist.", param="weight_dir")
    has_files = directory is not None and directory.is_dir() and (
        any(directory.glob("*.safetensors")) or (directory / "model.safetensors.index.json").exists())
    if not has_files and state.weights.broadcaster is not None:
        # Prime-RL's NCCL mode sends the step directory (it holds only STABLE/NCCL_READY markers) or null.
        return await broadcast_update(state, directory, version, timeout)
    if directory is None:
        raise ApiError(400, "weight_dir is null but no broadcaster is initialized: call /init_broadcaster first, "
                            "or send a checkpoint directory.", param="weight_dir")
    return await disk_update(state, directory, version, "disk")


async def reload_weights(state: AppState, version: str | None) -> UpdateOutcome:
    """Re-read the served model's own checkpoint (the operator chose it: the request allow-list does not apply)."""
    state.check_engine()
    return await disk_update(state, Path(state.settings.model).resolve(), version or "default", "reload",
                             idempotent=False)


async def disk_update(state: AppState, directory: Path, version: str | None, source: str,
                      idempotent: bool = True) -> UpdateOutcome:
    mgr = state.weights
    # Validate, then apply: only headers are read here, nothing touches the model before every check passed.
    ck = await asyncio.to_thread(scan_checkpoint, directory)
    check = await asyncio.to_thread(check_checkpoint, ck, await mgr.expected(), mgr.model_dir)
    if check.cast:
        sample = ", ".join(f"{k} {a}->{b}" for k, (a, b) in list(check.cast.items())[:4])
        log.info("checkpoint %s: %d tensor(s) differ in dtype and are cast on load (%s)", directory,
                 len(check.cast), sample)
    buffers = [n for n in check.skipped if is_buffer(n)]
    if buffers:
        log.info("checkpoint %s: skipping %d non-parameter buffer(s): %s", directory, len(buffers),
                 ", ".join(buffers[:4]))
    if len(buffers) < len(check.skipped):
        log.info("checkpoint %s: skipping %s, equal to the embedding the model ties its head to", directory,
                 ", ".join(n for n in check.skipped if n not in buffers))
    key = f"disk:{directory}:{ck.fingerprint}" if idempotent else None

    async def work() -> UpdateOutcome:
        mgr.counter += 1
        label = derive_version(version, directory, mgr.counter)

        async def load() -> list[Any]:
            return await state.engine.load_checkpoint([str(f) for f in ck.files], check.skipped)

        # What a staged delta builds on (app/weights/staging.py): these files, as they were when loaded.
        origin = {"kind": "base" if source == "reload" else "checkpoint", "dir": str(directory),
                  "files": [str(f) for f in ck.files], "fingerprint": ck.fingerprint}
        out = await mgr.apply(source, load, label, ck.total_bytes, f"loading weights from {directory}", origin)
        out.skipped = check.skipped
        return out

    # Under the control lock: pause/resume calls sent meanwhile run after the update, in order (app/server/control.py).
    return await mgr.run(key, state.control.guard(f"weight update ({source})", work), version)


async def commit_staged(state: AppState, version: str, mode: str | None) -> dict[str, Any]:
    """Prime-RL's ``/commit``: apply a staged version (a delta in the workers' copy, a full one as a checkpoint
    update); the answer's body."""
    mgr = state.staging
    entry = mgr.lookup(version, mode)
    if entry is None:
        return {"status": "ok", "active_version": version, "mode": mode or mgr.last_mode, "noop": True,
                "seconds": 0.0}
    workers: dict[str, Any] = {}
    if entry.mode == "delta":
        out, workers = await mgr.commit_delta(entry)
    else:
        entry.committing = True
        try:
            out = await disk_update(state, entry.artifact, entry.version, "staged")
        finally:
            entry.committing = False
        mgr.committed(entry)
    return {"status": "ok", "active_version": entry.version, "mode": entry.mode, "noop": out.noop,
            "seconds": round(out.seconds, 4), "reload_seconds": out.reload_seconds, "bytes": out.bytes,
            "workers": workers}


# ------------------------------------------------------------------------------------------ broadcast


async def init_broadcaster(state: AppState, *, host: str, port: int, rank_offset: int, inference_world_size: int,
                           timeout: float, backend: str | None) -> dict[str, Any]:
    """Join the trainer's weight-broadcast group (Prime-RL's NCCL protocol; gloo on CPU); the answer's body."""
    state.check_engine()
    backend = backend or ("gloo" if on_cpu() else "nccl")
    if backend not in ("nccl", "gloo"):
        raise ApiError(400, f"backend must be nccl or gloo, got {backend!r}.", param="backend")
    if backend == "nccl" and on_cpu():
        raise ApiError(501, "the nccl backend needs a GPU; on CPU the broadcast runs over gloo.", param="backend")
    mgr = state.weights
    if mgr.busy or mgr.lock.locked():
        raise ApiError(409, "a weight update is running; call /init_broadcaster when it has finished.")

    async def join() -> list[Any]:
        async with mgr.lock:
            mgr.broadcaster = None
            res = await state.engine.init_broadcaster(host=host, port=port, rank_offset=rank_offset,
                                                      inference_world_size=inference_world_size,
                                                      timeout=timeout, backend=backend)
            mgr.broadcaster = {"host": host, "port": port, "rank_offset": rank_offset,
                               "inference_world_size": inference_world_size, "timeout": timeout,
                               "backend": backend}
            # Logged here, not in the caller: the join completes even when the caller has gone away.
            log.info("broadcaster ready: %s:%d backend=%s ranks=%s of %d", host, port, backend,
                     sorted(int(r["rank"]) for r in res if isinstance(r, dict)), inference_world_size + 1)
            return res

    results = await engine_call(state, join(), "joining the broadcast group")
    ranks = sorted(int(r["rank"]) for r in results if isinstance(r, dict))
    return {"status": "ok", "backend": backend, "ranks": ranks, "world_size": inference_world_size + 1}


async def broadcast_update(state: AppState, directory: Path | None, version: str | None,
                           timeout: float | None) -> UpdateOutcome:
    mgr = state.weights
    assert mgr.broadcaster is not None
    wait = timeout or float(mgr.broadcaster["timeout"])
    expected = await mgr.expected()
    spec = {k: list(v.shape) for k, v in expected.items()}
    tied_to = tied_embedding(mgr.model_dir, expected)
    # A retry of the same step joins the running receive or is a no-op after it: a second receive would hang.
    key = f"broadcast:{directory}" if directory is not None else None

    async def work() -> UpdateOutcome:
        mgr.counter += 1
        label = derive_version(version, directory, mgr.counter)
        results: list[Any] = []

        async def load() -> list[Any]:
            try:
                results.extend(await state.engine.receive_broadcast(spec, wait, tied_to))
            except Exception as e:
                if "group was dropped" in str(e):
                    mgr.broadcaster = None
                raise
            return results

        out = await mgr.apply("broadcast", load, label, 0, "receiving the weight broadcast")
        out.bytes = sum(int(r.get("bytes", 0)) for r in results if isinstance(r, dict))
        out.skipped = sorted({str(n) for r in results if isinstance(r, dict) for n in r.get("skipped", ())})
        return out

    return await mgr.run(key, state.control.guard("weight update (broadcast)", work), version)


# ------------------------------------------------------------------------------------------ vLLM's weight transfer


def require_transfer_engine(state: AppState) -> None:
    """vLLM's native weight-transfer calls need its weight-transfer engine: 501 on CPU, 400 when not configured."""
    if state.engine.weight_transfer_backend is None:
        if on_cpu():
            raise ApiError(501, "vLLM's weight-transfer engine needs a GPU backend (nccl, ipc, ...), which this CPU "
                                "server cannot run; use /init_broadcaster and /update_weights "
                                "{\"weight_dir\": null} (gloo) or /update_weights {\"weight_dir\": ...}.")
        raise ApiError(400, "vLLM's weight-transfer engine is not configured: start tito with "
                            "--weight-transfer-backend nccl (or ipc, ...).")


async def init_transfer_engine(state: AppState, init_info: dict[str, Any], busy: str) -> None:
    """vLLM's ``init_weight_transfer_engine``; ``busy``: what a caller does when an update is running (409)."""
    require_transfer_engine(state)
    mgr = state.weights
    if mgr.busy or mgr.lock.locked():
        raise ApiError(409, f"a weight update is running; {busy} when it has finished.")
    await engine_call(state, state.engine.init_weight_transfer_engine(init_info), "init_weight_transfer_engine")


def _transfer_ready(state: AppState) -> None:
    require_transfer_engine(state)
    state.check_engine()


async def start_weight_update(state: AppState) -> None:
    _transfer_ready(state)
    await state.weights.native("start", state.engine.start_weight_update)


async def update_weights(state: AppState, update_info: Any) -> None:
    """vLLM's ``update_weights`` (its ``update_info``: an object, or a list of per-worker objects)."""
    _transfer_ready(state)
    if not isinstance(update_info, (dict, list)):
        raise ApiError(400, "update_info must be an object (or a list of per-worker objects).", param="update_info")
    await state.weights.native("update", lambda: state.engine.update_weights(update_info))


async def finish_weight_update(state: AppState, version: str | None) -> None:
    _transfer_ready(state)
    await state.weights.native("finish", lambda: state.engine.finish_weight_update(version), version)


async def set_weight_version(state: AppState, version: str) -> None:
    """vLLM's ``update_weight_version``: the label in the engine, then tito's (and its metric)."""
    state.check_engine()
    await engine_call(state, state.engine.set_weight_version(version), "update_weight_version")
    state.weight_version = version
    metrics.WEIGHT_VERSION.info({"version": version})


async def weight_version(state: AppState, what: str) -> Any:
    """The engine's weight version label (``what``: the call, for its error message)."""
    state.check_engine()
    return await engine_call(state, state.engine.get_weight_version(), what)
