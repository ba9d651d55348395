"""Generation control for RL trainers: ``POST /pause``, ``POST /resume``, ``GET /is_paused`` (vLLM's routes and shapes).

Pause, resume and weight updates run one at a time in arrival order (``app/control.py`` says what concurrent calls
do); each runs in its own task, so a client that disconnects or times out does not leave the engine half-paused.
"""

from __future__ import annotations

import logging
from typing import Literal

from fastapi import APIRouter, Depends, Query
from starlette.responses import Response

from app import metrics
from app.control import pause_generation, resume_generation
from app.protocol import ERROR_RESPONSES, json_response
from app.state import AppState, get_state

log = logging.getLogger("tito.control")
router = APIRouter(tags=["control"])

PauseMode = Literal["abort", "wait", "keep"]


@router.post("/pause", responses=ERROR_RESPONSES, summary="Pause generation (abort | wait | keep in-flight requests)")
async def pause(mode: PauseMode = Query("abort"), clear_cache: bool = Query(True),
                timeout: float = Query(300.0, gt=0, description="Seconds to wait for earlier control calls and, with "
                                                                "mode=wait, for the drain; a drain that does not end "
                                                                "in time is cancelled (504)."),
                state: AppState = Depends(get_state)) -> Response:
    await pause_generation(state, mode, clear_cache, timeout)
    return json_response({"status": "paused"})


@router.post("/resume", responses=ERROR_RESPONSES, summary="Resume generation")
async def resume(timeout: float = Query(600.0, gt=0, description="Seconds to wait for a running weight update and "
                                                                 "earlier control calls (409 after that)."),
                 state: AppState = Depends(get_state)) -> Response:
    await resume_generation(state, timeout)
    return json_response({"status": "resumed"})


@router.get("/is_paused", responses=ERROR_RESPONSES, summary="Is generation paused?")
async def is_paused(state: AppState = Depends(get_state)) -> Response:
    state.check_engine()
    paused = await state.engine.is_paused()
    metrics.PAUSED.set(1 if paused else 0)
    return json_response({"is_paused": paused})
