"""Generation control as every transport asks for it: pause, resume, is-paused. HTTP (routers/control.py) and gRPC
(app/grpc/vllm_control.py) call these; the order of concurrent calls is the control plane's (app/server/control.py),
each transition in its own task, so a caller that leaves never leaves the engine half-paused."""

from __future__ import annotations

import logging

from app.core import metrics
from app.core.protocol import ApiError
from app.server.state import AppState

log = logging.getLogger("tito.control")


async def pause_generation(state: AppState, mode: str, clear_cache: bool, timeout: float, *,
                           lease: float | None = None, shield: bool = True) -> None:
    """Pause (``mode``: abort, wait or keep the requests in flight), with the control plane's error answers.
    ``lease``: seconds without a control call after which tito resumes by itself (None: ``--pause-lease``).
    ``shield=False`` only for a caller that is never cancelled (see ``ControlPlane.run``)."""
    state.check_engine()
    if lease is None:
        lease = state.settings.pause_lease
    try:
        # keep: vLLM keeps the frozen requests' KV, so clearing the cache does not apply (vLLM ignores it too).
        await state.control.pause(mode, clear_cache and mode != "keep", timeout, lease=lease, shield=shield)
        state.weights.keep_cache = not clear_cache  # what the updates under this pause do with the prefix cache
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001 - reported in the envelope, never a bare 500
        raise state.engine_error(e, "pause", failed=f"Failed to pause generation: {e}") from None
    log.info("generation paused (mode=%s, clear_cache=%s%s)", mode, clear_cache,
             f", lease={lease:g}s" if lease else "")


async def resume_generation(state: AppState, timeout: float, *, shield: bool = True) -> None:
    state.check_engine()
    try:
        # Resuming mid-load would generate from half-updated weights: a running update finishes first.
        await state.control.resume(timeout, shield=shield)
        state.weights.keep_cache = False
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001
        raise state.engine_error(e, "resume", failed=f"Failed to resume generation: {e}") from None
    log.info("generation resumed")


async def is_paused(state: AppState) -> bool:
    state.check_engine()
    paused = await state.engine.is_paused()
    metrics.PAUSED.set(1 if paused else 0)
    return paused
