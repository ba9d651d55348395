"""Generation control for RL trainers: ``POST /pause``, ``POST /resume``, ``GET /is_paused`` (vLLM's routes and shapes).

Engine calls are shielded: a client that disconnects or times out does not leave the engine half-paused.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from fastapi import APIRouter, Depends, Query
from starlette.responses import Response

from app import metrics
from app.protocol import ERROR_RESPONSES, ApiError, json_response
from app.state import AppState, get_state

log = logging.getLogger("tito.control")
router = APIRouter(tags=["control"])

PauseMode = Literal["abort", "wait", "keep"]


async def _shielded(aw: asyncio.Future[object] | asyncio.Task[object], timeout: float, what: str) -> object:
    """Await an engine call that must complete even if this request is cancelled; a timeout is a 504."""
    try:
        return await asyncio.wait_for(asyncio.shield(aw), timeout)
    except TimeoutError:
        raise ApiError(504, f"{what} did not finish within {timeout:g}s; it continues on the server.") from None


@router.post("/pause", responses=ERROR_RESPONSES, summary="Pause generation (abort | wait | keep in-flight requests)")
async def pause(mode: PauseMode = Query("abort"), clear_cache: bool = Query(True),
                timeout: float = Query(300.0, gt=0, description="Seconds to wait for mode=wait to drain."),
                state: AppState = Depends(get_state)) -> Response:
    state.check_engine()
    # keep: vLLM keeps the frozen requests' KV, so clearing the cache does not apply (vLLM ignores it too).
    task = asyncio.ensure_future(state.engine.pause(mode=mode, clear_cache=clear_cache and mode != "keep"))
    metrics.PAUSED.set(1)
    try:
        await _shielded(task, timeout, f"pause (mode={mode})")
    except ApiError:
        raise
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    except Exception as e:  # noqa: BLE001 - reported in the envelope, never a bare 500
        log.exception("pause failed")
        raise ApiError(500, f"Failed to pause generation: {e}") from None
    log.info("generation paused (mode=%s, clear_cache=%s)", mode, clear_cache)
    return json_response({"status": "paused"})


@router.post("/resume", responses=ERROR_RESPONSES, summary="Resume generation")
async def resume(timeout: float = Query(600.0, gt=0, description="Seconds to wait for a running weight update."),
                 state: AppState = Depends(get_state)) -> Response:
    state.check_engine()
    mgr = state.weights
    if mgr.busy:
        # Resuming mid-load would generate from half-updated weights: let the running update (disk, broadcast, or
        # a native one until /finish_weight_update) finish first.
        log.info("resume waits for the running weight update")
        if not await mgr.wait_idle(timeout):
            raise ApiError(409, f"a weight update is still running after {timeout:g}s; resume later.")
    if mgr.inconsistent is not None:
        # Never resume onto a mix of weight versions; the update that repairs them resumes if it paused.
        raise ApiError(409, f"{mgr.inconsistent.message()} before resuming; /resume is refused until then.")
    try:
        await _shielded(asyncio.ensure_future(state.engine.resume()), 60.0, "resume")
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001
        log.exception("resume failed")
        raise ApiError(500, f"Failed to resume generation: {e}") from None
    metrics.PAUSED.set(0)
    log.info("generation resumed")
    return json_response({"status": "resumed"})


@router.get("/is_paused", responses=ERROR_RESPONSES, summary="Is generation paused?")
async def is_paused(state: AppState = Depends(get_state)) -> Response:
    state.check_engine()
    paused = await state.engine.is_paused()
    metrics.PAUSED.set(1 if paused else 0)
    return json_response({"is_paused": paused})
