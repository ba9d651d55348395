"""Generation control for RL trainers: ``POST /pause``, ``POST /resume``, ``GET /is_paused``, ``POST
/reset_prefix_cache`` (vLLM's routes and shapes).

Pause, resume and weight updates run one at a time in arrival order (``app/server/control.py`` says what concurrent
calls do). These handlers run their transition in place (``shield=False``): uvicorn never cancels a handler whose
client disconnects or times out, so the transition still ends whole (tests/test_control.py shows it), without the
task hand-overs a shielded one waits for under load.
The routes parse; app/server/control_service.py does the rest, for gRPC too.
"""

from __future__ import annotations

import logging
from typing import Literal

import orjson
from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import Response

from app.core.protocol import ERROR_RESPONSES, ApiError, json_response
from app.server import control_service as svc
from app.server.state import AppState, get_state

log = logging.getLogger("tito.control")
router = APIRouter(tags=["control"])

PauseMode = Literal["abort", "wait", "keep"]


@router.post("/pause", responses=ERROR_RESPONSES, summary="Pause generation (abort | wait | keep in-flight requests)")
async def pause(mode: PauseMode = Query("abort"), clear_cache: bool = Query(True),
                timeout: float = Query(300.0, gt=0, description="Seconds to wait for earlier control calls and, with "
                                                                "mode=wait, for the drain; a drain that does not end "
                                                                "in time is cancelled (504)."),
                lease: float | None = Query(None, ge=0, description="Seconds after which tito resumes by itself if "
                                                                    "no control call (resume, update, pause) comes; "
                                                                    "0: none; default: --pause-lease."),
                state: AppState = Depends(get_state)) -> Response:
    await svc.pause_generation(state, mode, clear_cache, timeout, lease=lease, shield=False)
    return json_response({"status": "paused"})


@router.post("/resume", responses=ERROR_RESPONSES, summary="Resume generation")
async def resume(timeout: float = Query(600.0, gt=0, description="Seconds to wait for a running weight update and "
                                                                 "earlier control calls (409 after that)."),
                 state: AppState = Depends(get_state)) -> Response:
    await svc.resume_generation(state, timeout, shield=False)
    return json_response({"status": "resumed"})


@router.get("/is_paused", responses=ERROR_RESPONSES, summary="Is generation paused?")
async def is_paused(state: AppState = Depends(get_state)) -> Response:
    return json_response({"is_paused": await svc.is_paused(state)})


@router.post("/reset_prefix_cache", responses=ERROR_RESPONSES,
             summary="Reset the prefix cache (vLLM's route: {\"success\": bool}; false while blocks are held)")
async def reset_prefix_cache(request: Request,
                             reset_running_requests: bool | None = Query(None, description="Also evict the KV of "
                                                                         "running requests (they recompute it)."),
                             reset_external: bool | None = Query(None, description="Also the KV connector's cache."),
                             timeout: float = Query(60.0, gt=0, description="Seconds to wait for a running weight "
                                                                            "update and earlier control calls."),
                             state: AppState = Depends(get_state)) -> Response:
    # vLLM reads the query only; SkyRL sends {"reset_running_requests": ...} as a JSON body, so that is read too
    # (the query wins).
    body = await request.body()
    sent: dict[str, object] = {}
    if body.strip():
        try:
            sent = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise ApiError(400, "request body is not valid JSON.", param="body") from None
        if not isinstance(sent, dict):
            raise ApiError(400, "request body must be a JSON object.", param="body")
    flags = {}
    for name, given in (("reset_running_requests", reset_running_requests), ("reset_external", reset_external)):
        value = given if given is not None else sent.get(name, False)
        if not isinstance(value, bool):
            raise ApiError(400, f"{name} must be a boolean.", param=name)
        flags[name] = value
    state.check_engine()
    ok = await state.control.reset_prefix_cache(flags["reset_running_requests"], flags["reset_external"], timeout,
                                                shield=False)
    log.info("prefix cache reset (reset_running_requests=%s): %s", flags["reset_running_requests"], ok)
    return json_response({"success": ok})
