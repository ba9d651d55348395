"""vLLM's exceptions as tito's: the one place that says which engine failure is what.

- ``EngineDead``: an EngineCore process is gone (vLLM's ``EngineDeadError``, or any failure once the engine has
  errored); every surface answers 503.
- ``EngineRejected``: the engine refused the caller's input (``REFUSED_INPUT``); the engine keeps serving and the
  surfaces answer 400, naming the parameter when vLLM does.
- Anything else is the server's failure (500, logged).

``AppState.engine_error`` (app/server/state.py) turns these into tito's answers for the token API, the gRPC services
and the admin calls. vLLM's OpenAI routes answer as vLLM's server does (``vllm_error_response``): the same dead
engine, and vLLM's own envelope for what its exception handlers answer.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

# Prefix vLLM puts on a failed engine utility call (add_lora etc.); the rest of the message is the engine's reason.
UTILITY_FAILED = re.compile(r"^Call to \w+ method failed: ")


class EngineDead(RuntimeError):
    """The engine (an EngineCore process) is gone: every call fails until the server restarts."""


class EngineRejected(ValueError):
    """The engine refused what it was given (a sampling parameter, an adapter it cannot load); it keeps serving."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


def refused_input() -> tuple[type[Exception], ...]:
    """What vLLM raises for input it refuses: its client errors and the raw exceptions it has not migrated yet (the
    fallbacks of vLLM's own ``create_error_response``)."""
    from vllm.exceptions import VLLMClientError

    return (ValueError, TypeError, OverflowError, VLLMClientError)


def translate(e: BaseException, *, errored: bool, refused: bool = False) -> BaseException:
    """``e`` as ``EngineDead`` / ``EngineRejected``, or as it is (a timeout, a cancellation, the server's own
    failure). ``errored``: the engine is known dead. ``refused``: any failure of a live engine is its refusal of the
    input (a utility call such as add_lora)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(e, (EngineDead, EngineRejected, TimeoutError, asyncio.CancelledError)):
        return e
    if isinstance(e, EngineDeadError) or errored:
        return EngineDead(str(e))
    if refused or isinstance(e, refused_input()):
        return EngineRejected(UTILITY_FAILED.sub("", str(e)), getattr(e, "parameter", None))
    return e


def vllm_error_response(e: BaseException) -> Any:
    """vLLM's own error answer (its ``ErrorResponse``) for what vLLM's server answers through its exception
    handlers: refused input (400, or the status of vLLM's client error), vLLM's server errors and
    ``NotImplementedError`` (501). None for a dead engine and anything else: the caller maps those as tito does."""
    from vllm.entrypoints.serve import create_error_response
    from vllm.exceptions import VLLMError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(e, (EngineDeadError, EngineDead)) or not isinstance(e, Exception):
        return None
    if isinstance(e, (*refused_input(), VLLMError, NotImplementedError)):
        return create_error_response(e)
    return None
