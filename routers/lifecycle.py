"""Drain and abort: take a replica out of rotation without losing a request; cancel requests by id.

- ``POST /drain {"timeout": s}``: stop admitting generate requests (503 + ``Retry-After``), wait for the in-flight
  ones (up to ``timeout``), answer with counts. ``GET /drain``: state. ``DELETE /drain`` / ``POST /undrain``: readmit.
- ``POST /abort_requests {"request_ids": [...]}`` (also ``/inference/v1/abort_requests``): abort by the client's ids
  or the ``generate-tokens-`` ids; ``{}`` aborts everything. Aborted requests answer with their partial tokens and
  ``finish_reason: "abort"``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from app.core.protocol import ERROR_RESPONSES, ApiError, json_response, parse_json_body
from app.server.state import AppState, get_state

log = logging.getLogger("tito.lifecycle")
router = APIRouter(tags=["lifecycle"])


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float = Field(30.0, ge=0, le=24 * 3600,
                           description="Seconds to wait for in-flight requests before answering (they are never "
                                       "aborted by a drain; the server keeps draining after the answer).")


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    request_ids: list[str] | None = Field(None, description="Ids to abort; missing or null aborts every request.")


async def _body(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    if not raw.strip():
        return model()
    return parse_json_body(model, raw)


def _drain_status(state: AppState) -> dict[str, Any]:
    return {"draining": state.draining, "shutting_down": state.shutting_down, "inflight": state.inflight,
            "since": state.drain_started_at}


@router.post("/drain", responses=ERROR_RESPONSES, summary="Stop admitting generate requests; wait for in-flight")
async def drain(request: Request, state: AppState = Depends(get_state)) -> Response:
    req: DrainRequest = await _body(request, DrainRequest)
    t0 = time.monotonic()
    already = state.draining
    # Out of the fleet first (the child sidecar stops, the frontend stops routing here), then refuse.
    left = None if already or state.shutting_down else await state.leave_fleet("drain")
    state.start_drain()
    await state.settled()  # with several API processes: none admits a request from here
    at_start = state.inflight
    if not already:
        log.info("draining: %d request(s) in flight, waiting up to %gs", at_start, req.timeout)
    idle = await state.wait_idle(req.timeout)
    return json_response({
        "status": "drained" if idle else "timeout",
        **_drain_status(state),
        "inflight_at_start": at_start,
        "finished": state.finished_since_drain,
        "still_running": state.inflight,
        "waited_s": round(time.monotonic() - t0, 3),
        "left_fleet_s": round(left, 3) if left is not None else None,
    })


@router.get("/drain", summary="Drain state and in-flight count")
async def drain_status(state: AppState = Depends(get_state)) -> Response:
    return json_response({**_drain_status(state), "finished": state.finished_since_drain if state.draining else 0})


async def _undrain(state: AppState) -> Response:
    if state.shutting_down:
        raise ApiError(409, "server is shutting down; it cannot be undrained.")
    was = state.draining
    state.stop_drain()
    state.rejoin_fleet()  # a new sidecar: back in discovery
    if was:
        log.info("undrained: admitting new requests")
    return json_response({"status": "admitting", **_drain_status(state)})


@router.delete("/drain", responses=ERROR_RESPONSES, summary="Admit new generate requests again")
async def undrain(state: AppState = Depends(get_state)) -> Response:
    return await _undrain(state)


@router.post("/undrain", responses=ERROR_RESPONSES, summary="Admit new generate requests again")
async def undrain_post(state: AppState = Depends(get_state)) -> Response:
    return await _undrain(state)


@router.post("/abort_requests", responses=ERROR_RESPONSES, summary="Abort requests by id, or all with {}")
@router.post("/inference/v1/abort_requests", responses=ERROR_RESPONSES, include_in_schema=False)
async def abort_requests(request: Request, state: AppState = Depends(get_state)) -> Response:
    req: AbortRequest = await _body(request, AbortRequest)
    n = await state.abort(req.request_ids)
    if n:
        log.info("aborted %d request(s)%s", n, "" if req.request_ids is not None else " (all)")
    return json_response({"status": "aborted", "aborted": n})
