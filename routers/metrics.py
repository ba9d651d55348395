"""``GET /metrics``: Prometheus text — the engine's own ``vllm:*`` families and tito's ``tito_*`` families (with
several API processes, of all of them: the control process answers, from prometheus_client's multiprocess files).

The in-process ``AsyncLLM`` (built with ``disable_log_stats=False``) registers its families on prometheus_client's
default registry, so one ``generate_latest()`` serves both; Prime-RL's concurrency controller reads the ``vllm:``
ones (``cache_config_info``, ``kv_cache_usage_perc``, ``num_requests_running/waiting[_by_reason]``,
``num_preemptions``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest, multiprocess
from starlette.responses import Response

from app.core.metrics import DRAINING, LIVE, PAUSED, WEIGHT_VERSION
from app.server.state import AppState

log = logging.getLogger("tito.metrics")
router = APIRouter(tags=["metrics"])


async def refresh_state_gauges(state: AppState) -> None:
    """Set the state gauges from the truth at scrape time, whoever changed the state and however."""
    DRAINING.set(1 if state.draining or state.shutting_down else 0)
    WEIGHT_VERSION.info({"version": str(state.weight_version)})
    if state.engine.errored:
        return
    try:
        # Bounded: an engine busy in a blocking collective (a weight broadcast) must not hang the scrape.
        PAUSED.set(1 if await asyncio.wait_for(state.engine.is_paused(), 2.0) else 0)
    except Exception as e:  # noqa: BLE001 - a scrape must not fail because the engine is busy dying
        log.debug("is_paused failed during scrape: %s", e)


@functools.cache
def registry() -> CollectorRegistry:
    """One process: the default registry. Several API processes (prometheus_client's multiprocess mode, set up by
    ``tito serve``): every process's families summed from their files, and the state this (control) process holds."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return REGISTRY
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg)
    for family in LIVE:
        reg.register(family)
    return reg


@router.get("/metrics", summary="Prometheus metrics (engine vllm:* and tito_*)",
            response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(request: Request) -> Response:
    state: AppState | None = getattr(request.app.state, "tito", None)
    if state is not None:
        await refresh_state_gauges(state)
    return Response(generate_latest(registry()), media_type=CONTENT_TYPE_LATEST)
