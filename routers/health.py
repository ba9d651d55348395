"""``GET /health``: 200 while the engine is alive, 503 once it is dead."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.responses import Response

from app.protocol import json_response
from app.state import AppState, get_state

router = APIRouter(tags=["health"])


@router.get("/health", summary="Engine alive?")
async def health(state: AppState = Depends(get_state)) -> Response:
    if state.engine.errored:
        failure = state.engine_failure or {}
        return json_response({"status": "dead", "error": failure.get("cause", "engine is dead")}, 503)
    return json_response({"status": "ok", "draining": state.draining})
