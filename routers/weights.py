"""Weight routes: Prime-RL's (``/update_weights`` from disk or a broadcast, ``/init_broadcaster``), ``/reload_weights``,
and vLLM's native weight-transfer routes (``/init_weight_transfer_engine`` ... ``/get_world_size``).

``POST /update_weights`` serves both callers: ``{"update_info": ...}`` is vLLM's native body, anything else
(``weight_dir``/``weight_version``) is Prime-RL's. The routes parse; app/server/weight_service.py does the rest,
for gRPC too.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import Response

from app.core.protocol import ERROR_RESPONSES, ApiError, json_response, validation_error
from app.server import weight_service as svc
from app.server.state import AppState, get_state

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


# ------------------------------------------------------------------------------------------ Prime-RL / from disk


@router.post("/update_weights", responses=ERROR_RESPONSES,
             summary="Load weights: from a directory, a trainer broadcast, or vLLM's update_info")
async def update_weights(request: Request, state: AppState = Depends(get_state)) -> Response:
    body = await _json_body(request)
    state.check_engine()
    if "update_info" in body:
        return await _native_update(state, body)
    req: DiskUpdate = _parse(DiskUpdate, body)
    outcome = await svc.update_from_dir(state, req.weight_dir, req.weight_version, req.timeout)
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
    outcome = await svc.reload_weights(state, version)
    return json_response(outcome.body())


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
    return json_response(await svc.init_broadcaster(
        state, host=req.host, port=req.port, rank_offset=req.rank_offset,
        inference_world_size=req.inference_world_size, timeout=req.timeout, backend=req.backend))


# ------------------------------------------------------------------------------------------ vLLM native routes


async def _native_update(state: AppState, body: dict[str, Any]) -> Response:
    await svc.update_weights(state, body["update_info"])
    return json_response({"message": "Weights updated"})


@router.post("/init_weight_transfer_engine", responses=ERROR_RESPONSES, summary="vLLM: join the weight transfer")
async def init_weight_transfer_engine(request: Request, state: AppState = Depends(get_state)) -> Response:
    body = await _json_body(request)
    if not isinstance(body.get("init_info"), dict):
        raise ApiError(400, "body must be {\"init_info\": {...}}.", param="init_info")
    await svc.init_transfer_engine(state, body["init_info"], "call /init_weight_transfer_engine")
    return json_response({"message": "Weight transfer initialized"})


@router.post("/start_weight_update", responses=ERROR_RESPONSES, summary="vLLM: start a weight update")
async def start_weight_update(request: Request, state: AppState = Depends(get_state)) -> Response:
    await _json_body(request, required=False)  # every version's optional body is accepted
    await svc.start_weight_update(state)
    return json_response({"message": "Weight update started"})


@router.post("/finish_weight_update", responses=ERROR_RESPONSES, summary="vLLM: finish a weight update")
async def finish_weight_update(request: Request, state: AppState = Depends(get_state)) -> Response:
    body = await _json_body(request, required=False)
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise ApiError(400, "weight_version must be a string.", param="weight_version")
    await svc.finish_weight_update(state, version)
    return json_response({"message": "Weight update finished"})


@router.post("/update_weight_version", responses=ERROR_RESPONSES, summary="vLLM: set the weight version label")
async def update_weight_version(request: Request, state: AppState = Depends(get_state)) -> Response:
    body = await _json_body(request)
    version = body.get("new_version")
    if not isinstance(version, str) or not version:
        raise ApiError(400, "body must be {\"new_version\": \"<label>\"}.", param="new_version")
    await svc.set_weight_version(state, version)
    return json_response({"success": True, "new_version": version})


@router.get("/weight_info", responses=ERROR_RESPONSES, summary="vLLM: current weight version")
async def weight_info(state: AppState = Depends(get_state)) -> Response:
    version = await svc.weight_version(state, "weight_info")
    return json_response({"weight_version": version})


@router.get("/get_world_size", responses=ERROR_RESPONSES, summary="vLLM: workers behind this server")
async def get_world_size(include_dp: bool = Query(True), state: AppState = Depends(get_state)) -> Response:
    return json_response({"world_size": state.engine.world_size(include_dp)})
