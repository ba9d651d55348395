"""Weight routes: Prime-RL's (``/update_weights`` from disk or a broadcast, ``/init_broadcaster``), ``/reload_weights``,
and vLLM's native weight-transfer routes (``/init_weight_transfer_engine`` ... ``/get_world_size``).

``POST /update_weights`` serves both callers: ``{"update_info": ...}`` is vLLM's native body, anything else
(``weight_dir``/``weight_version``) is Prime-RL's.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import Response

from app.core.protocol import ERROR_RESPONSES, ApiError, json_response, validation_error
from app.engine.adapter import on_cpu
from app.server.state import AppState, get_state
from app.weights.paths import resolve_allowed
from app.weights.updates import UpdateOutcome, derive_version, scan_checkpoint, validate, worker_error

log = logging.getLogger("tito.weights")
router = APIRouter(tags=["weights"])

_DEFAULT_BCAST_TIMEOUT = 1200.0  # Prime-RL's default `timeout` for the broadcast


class DiskUpdate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    weight_dir: str | None = None
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)
    timeout: float | None = Field(default=None, gt=0, description="Broadcast receive timeout (seconds).")


class InitBroadcaster(BaseModel):
    """Prime-RL's ``/init_broadcaster`` body (NCCL on GPU; the same protocol over gloo on CPU)."""

    model_config = ConfigDict(extra="ignore")
    host: str = "localhost"
    port: int = Field(29501, ge=1, le=65535)
    rank_offset: int = Field(0, ge=0)
    inference_world_size: int = Field(1, ge=1)
    timeout: float = Field(_DEFAULT_BCAST_TIMEOUT, gt=0)
    quantize_in_weight_transfer: bool = False
    session_id: str | None = None  # NIXL/ModelExpress only: answered 501
    backend: str | None = Field(default=None, description="nccl or gloo; default nccl on GPU, gloo on CPU.")


async def _json_body(request: Request, *, required: bool = True) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise ApiError(400, "request body must be a JSON object.", param="body")
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ApiError(400, "request body is not valid JSON.", type="Bad Request", param="body") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object.", param="body")
    return body


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


async def _engine_call(state: AppState, aw: Any, what: str) -> Any:
    """An engine utility call shielded from request cancellation; failures become a clear answer."""
    task = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(task)
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001
        state.check_engine()
        raise worker_error(e, what) from None


# ------------------------------------------------------------------------------------------ Prime-RL / from disk


@router.post("/update_weights", responses=ERROR_RESPONSES,
             summary="Load weights: from a directory, a trainer broadcast, or vLLM's update_info")
async def update_weights(request: Request, state: AppState = Depends(get_state)) -> Response:
    body = await _json_body(request)
    state.check_engine()
    if "update_info" in body:
        return await _native_update(state, body)
    req: DiskUpdate = _parse(DiskUpdate, body)
    mgr = state.weights
    directory = resolve_allowed(state.settings, req.weight_dir, "weight_dir") if req.weight_dir else None
    if directory is not None and not directory.exists():
        raise ApiError(404, f"weight_dir {req.weight_dir!r} does not exist.", param="weight_dir")
    has_files = directory is not None and directory.is_dir() and (
        any(directory.glob("*.safetensors")) or (directory / "model.safetensors.index.json").exists())
    if not has_files and mgr.broadcaster is not None:
        # Prime-RL's NCCL mode sends the step directory (it holds only STABLE/NCCL_READY markers) or null.
        outcome = await _broadcast_update(state, directory, req)
    elif directory is None:
        raise ApiError(400, "weight_dir is null but no broadcaster is initialized: call /init_broadcaster first, "
                            "or send a checkpoint directory.", param="weight_dir")
    else:
        outcome = await _disk_update(state, directory, req.weight_version, "disk")
    return json_response(outcome.body())


@router.post("/reload_weights", responses=ERROR_RESPONSES, summary="Re-read the served model's own checkpoint")
async def reload_weights(request: Request, state: AppState = Depends(get_state)) -> Response:
    if request.headers.get("content-type", "").startswith(("application/x-www-form-urlencoded", "multipart/")):
        body = dict(await request.form())  # Prime-RL's stage/commit client posts form fields (resume, relay)
    else:
        body = await _json_body(request, required=False)
    state.check_engine()
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise ApiError(400, "weight_version must be a string.", param="weight_version")
    # The served model's own directory: the operator chose it, so the request allow-list does not apply.
    outcome = await _disk_update(state, Path(state.settings.model).resolve(), version or "default", "reload",
                                 idempotent=False)
    return json_response(outcome.body())


async def _disk_update(state: AppState, directory: Path, version: str | None, source: str,
                       idempotent: bool = True) -> UpdateOutcome:
    mgr = state.weights
    # Validate, then apply: only headers are read here, nothing touches the model before every check passed.
    ck = await asyncio.to_thread(scan_checkpoint, directory)
    expected = await mgr.expected()
    check = validate({k: v.shape for k, v in ck.tensors.items()}, {k: v.dtype for k, v in ck.tensors.items()},
                     expected)
    if check.cast:
        sample = ", ".join(f"{k} {a}->{b}" for k, (a, b) in list(check.cast.items())[:4])
        log.info("checkpoint %s: %d tensor(s) differ in dtype and are cast on load (%s)", directory,
                 len(check.cast), sample)
    if check.skipped:
        log.info("checkpoint %s: skipping %d non-parameter buffer(s): %s", directory, len(check.skipped),
                 ", ".join(check.skipped[:4]))
    key = f"disk:{directory}:{ck.fingerprint}" if idempotent else None

    async def work() -> UpdateOutcome:
        mgr.counter += 1
        label = derive_version(version, directory, mgr.counter)

        async def load() -> list[Any]:
            return await state.engine.load_checkpoint([str(f) for f in ck.files], check.skipped)

        # What a staged delta builds on (app/weights/staging.py): these files, as they were when loaded.
        origin = {"kind": "base" if source == "reload" else "checkpoint", "dir": str(directory),
                  "files": [str(f) for f in ck.files], "fingerprint": ck.fingerprint}
        return await mgr.apply(source, load, label, ck.total_bytes, f"loading weights from {directory}", origin)

    # Under the control lock: pause/resume calls sent meanwhile run after the update, in order (app/server/control.py).
    return await mgr.run(key, state.control.guard(f"weight update ({source})", work), version)


# ------------------------------------------------------------------------------------------ broadcast


@router.post("/init_broadcaster", responses=ERROR_RESPONSES,
             summary="Join the trainer's weight-broadcast group (Prime-RL NCCL protocol; gloo on CPU)")
async def init_broadcaster(request: Request, state: AppState = Depends(get_state)) -> Response:
    req: InitBroadcaster = _parse(InitBroadcaster, await _json_body(request))
    if req.session_id is not None:
        # Prime-RL's NIXL/ModelExpress transfer: a gloo/NCCL join would only wait for a rendezvous that never comes.
        raise ApiError(501, "session_id (Prime-RL's NIXL/ModelExpress weight transfer) is not supported; tito joins "
                            "NCCL broadcast groups (gloo on CPU): send /init_broadcaster without session_id, or "
                            "update from disk with /update_weights {\"weight_dir\": ...}.", param="session_id")
    state.check_engine()
    if req.quantize_in_weight_transfer:
        raise ApiError(501, "quantize_in_weight_transfer (kernel-format FP8 names) is not supported; send HF "
                            "checkpoint names.", param="quantize_in_weight_transfer")
    backend = req.backend or ("gloo" if on_cpu() else "nccl")
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
            res = await state.engine.init_broadcaster(host=req.host, port=req.port, rank_offset=req.rank_offset,
                                                      inference_world_size=req.inference_world_size,
                                                      timeout=req.timeout, backend=backend)
            mgr.broadcaster = {"host": req.host, "port": req.port, "rank_offset": req.rank_offset,
                               "inference_world_size": req.inference_world_size, "timeout": req.timeout,
                               "backend": backend}
            # Logged here, not in the handler: the join completes even when the caller has gone away.
            log.info("broadcaster ready: %s:%d backend=%s ranks=%s of %d", req.host, req.port, backend,
                     sorted(int(r["rank"]) for r in res if isinstance(r, dict)), req.inference_world_size + 1)
            return res

    results = await _engine_call(state, join(), "joining the broadcast group")
    ranks = sorted(int(r["rank"]) for r in results if isinstance(r, dict))
    return json_response({"status": "ok", "backend": backend, "ranks": ranks,
                          "world_size": req.inference_world_size + 1})


async def _broadcast_update(state: AppState, directory: Path | None, req: DiskUpdate) -> UpdateOutcome:
    mgr = state.weights
    assert mgr.broadcaster is not None
    timeout = req.timeout or float(mgr.broadcaster["timeout"])
    expected = await mgr.expected()
    spec = {k: list(v.shape) for k, v in expected.items()}
    # A retry of the same step joins the running receive or is a no-op after it: a second receive would hang.
    key = f"broadcast:{directory}" if directory is not None else None

    async def work() -> UpdateOutcome:
        mgr.counter += 1
        label = derive_version(req.weight_version, directory, mgr.counter)
        results: list[Any] = []

        async def load() -> list[Any]:
            try:
                results.extend(await state.engine.receive_broadcast(spec, timeout))
            except Exception as e:
                if "group was dropped" in str(e):
                    mgr.broadcaster = None
                raise
            return results

        out = await mgr.apply("broadcast", load, label, 0, "receiving the weight broadcast")
        out.bytes = sum(int(r.get("bytes", 0)) for r in results if isinstance(r, dict))
        return out

    return await mgr.run(key, state.control.guard("weight update (broadcast)", work), req.weight_version)


# ------------------------------------------------------------------------------------------ vLLM native routes


def _require_transfer_engine(state: AppState) -> None:
    if state.engine.weight_transfer_backend is None:
        if on_cpu():
            raise ApiError(501, "vLLM's weight-transfer engine needs a GPU backend (nccl, ipc, ...), which this CPU "
                                "server cannot run; use /init_broadcaster and /update_weights "
                                "{\"weight_dir\": null} (gloo) or /update_weights {\"weight_dir\": ...}.")
        raise ApiError(400, "vLLM's weight-transfer engine is not configured: start tito with "
                            "--weight-transfer-backend nccl (or ipc, ...).")


async def _native_update(state: AppState, body: dict[str, Any]) -> Response:
    _require_transfer_engine(state)
    state.check_engine()
    info = body["update_info"]
    if not isinstance(info, (dict, list)):
        raise ApiError(400, "update_info must be an object (or a list of per-worker objects).", param="update_info")
    await state.weights.native("update", lambda: state.engine.update_weights(info))
    return json_response({"message": "Weights updated"})


@router.post("/init_weight_transfer_engine", responses=ERROR_RESPONSES, summary="vLLM: join the weight transfer")
async def init_weight_transfer_engine(request: Request, state: AppState = Depends(get_state)) -> Response:
    body = await _json_body(request)
    if not isinstance(body.get("init_info"), dict):
        raise ApiError(400, "body must be {\"init_info\": {...}}.", param="init_info")
    _require_transfer_engine(state)
    mgr = state.weights
    if mgr.busy or mgr.lock.locked():
        raise ApiError(409, "a weight update is running; call /init_weight_transfer_engine when it has finished.")
    await _engine_call(state, state.engine.init_weight_transfer_engine(body["init_info"]),
                       "init_weight_transfer_engine")
    return json_response({"message": "Weight transfer initialized"})


@router.post("/start_weight_update", responses=ERROR_RESPONSES, summary="vLLM: start a weight update")
async def start_weight_update(request: Request, state: AppState = Depends(get_state)) -> Response:
    await _json_body(request, required=False)  # every version's optional body is accepted
    _require_transfer_engine(state)
    state.check_engine()
    await state.weights.native("start", state.engine.start_weight_update)
    return json_response({"message": "Weight update started"})


@router.post("/finish_weight_update", responses=ERROR_RESPONSES, summary="vLLM: finish a weight update")
async def finish_weight_update(request: Request, state: AppState = Depends(get_state)) -> Response:
    body = await _json_body(request, required=False)
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise ApiError(400, "weight_version must be a string.", param="weight_version")
    _require_transfer_engine(state)
    state.check_engine()
    await state.weights.native("finish", lambda: state.engine.finish_weight_update(version), version)
    return json_response({"message": "Weight update finished"})


def _set_version(state: AppState, version: str) -> None:
    from app.core import metrics

    state.weight_version = version
    metrics.WEIGHT_VERSION.info({"version": version})


@router.post("/update_weight_version", responses=ERROR_RESPONSES, summary="vLLM: set the weight version label")
async def update_weight_version(request: Request, state: AppState = Depends(get_state)) -> Response:
    body = await _json_body(request)
    version = body.get("new_version")
    if not isinstance(version, str) or not version:
        raise ApiError(400, "body must be {\"new_version\": \"<label>\"}.", param="new_version")
    state.check_engine()
    await _engine_call(state, state.engine.set_weight_version(version), "update_weight_version")
    _set_version(state, version)
    return json_response({"success": True, "new_version": version})


@router.get("/weight_info", responses=ERROR_RESPONSES, summary="vLLM: current weight version")
async def weight_info(state: AppState = Depends(get_state)) -> Response:
    state.check_engine()
    version = await _engine_call(state, state.engine.get_weight_version(), "weight_info")
    return json_response({"weight_version": version})


@router.get("/get_world_size", responses=ERROR_RESPONSES, summary="vLLM: workers behind this server")
async def get_world_size(include_dp: bool = Query(True), state: AppState = Depends(get_state)) -> Response:
    return json_response({"world_size": state.engine.world_size(include_dp)})
