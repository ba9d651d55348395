"""Probes: ``GET /health`` (engine alive?), ``GET /liveness`` (engine answering?), ``GET /ready`` (taking work?)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.core.protocol import json_response
from app.server.state import AppState, not_started

router = APIRouter(tags=["health"])


def _phase(state: AppState) -> str:
    if state.shutting_down:
        return "shutting_down"
    if state.draining:
        return "draining"
    return "serving"


def _state(request: Request) -> AppState | None:
    # Not the get_state dependency: the probes answer in their own shapes while the engine starts.
    state: AppState | None = getattr(request.app.state, "tito", None)
    if state is not None and state.peers is not None:
        state.peers.refresh(state)  # an API process of several: the control process's latest word
    return state


def _starting(request: Request, body: dict[str, Any]) -> Response:
    err = not_started(request)
    return json_response(body, 503, err.headers)


def dead_body(state: AppState) -> dict[str, Any]:
    cause = state.engine_death_cause()
    since = (state.engine_failure or {}).get("time", time.time())
    return {"status": "dead", "error": f"engine is dead: {cause}", "since": since}


@router.get("/health", summary="Engine alive? 200 while it is (also draining or paused); 503 while it starts and "
                               "once it is dead")
async def health(request: Request) -> Response:
    # A flag check, no engine call: Prime-RL polls this every second for up to 30 minutes at start-up.
    state = _state(request)
    if state is None:
        failed = getattr(request.app.state, "start_error", None)
        return _starting(request, {"status": "failed", "error": failed} if failed else {"status": "starting"})
    if state.engine.errored:
        return json_response(dead_body(state), 503)
    return json_response({"status": "ok", "state": _phase(state), "inflight": state.inflight})


@router.get("/liveness", summary="Round trip through the engine and its workers (no-op utility call)")
async def liveness(request: Request) -> Response:
    state = _state(request)
    if state is None:
        return _starting(request, {"status": "starting", "error": not_started(request).message})
    # Catches a hung engine, which /health cannot see. Prime-RL's route, same answers.
    if state.engine.errored:
        return json_response({"status": "engine_unresponsive", "error": dead_body(state)["error"]}, 503)
    timeout = state.settings.liveness_timeout
    t0 = time.monotonic()
    try:
        await state.engine.ping_workers(timeout)
    except TimeoutError:
        return json_response({"status": "engine_unresponsive", "error": f"no answer within {timeout:g}s"}, 503)
    except Exception as e:  # noqa: BLE001 - any failure of the round trip means "not live"
        return json_response({"status": "engine_unresponsive", "error": f"{type(e).__name__}: {e}"}, 503)
    return json_response({"status": "ok", "latency_ms": round((time.monotonic() - t0) * 1000, 2)})


@router.get("/ready", summary="200 only while the engine is up and the server admits new work")
async def ready(request: Request) -> Response:
    state = _state(request)
    if state is None:
        return _starting(request, {"status": "not_ready", "reason": "starting"})
    reason = state.not_ready_reason
    if reason is not None:
        return json_response({"status": "not_ready", "reason": reason}, 503)
    return json_response({"status": "ready"})
