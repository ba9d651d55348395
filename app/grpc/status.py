"""tito's HTTP error statuses as gRPC status codes, and the gRPC call counters.

An ``ApiError`` keeps its message: a gRPC client reads the same words an HTTP client reads in the 400/503 body.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc

from app.core.metrics import REJECTED, count_grpc, reject_reason
from app.core.protocol import ApiError

log = logging.getLogger("tito.grpc")


_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def grpc_code(status: int) -> grpc.StatusCode:
    return _CODES.get(status, grpc.StatusCode.INTERNAL)


class GrpcCall:
    """One call's outcome, counted once in ``tito_grpc_requests_total`` (and 4xx-like refusals in
    ``tito_rejected_requests_total``, with the HTTP status's reason, as HTTP counts them)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self._counted = False

    def done(self, code: grpc.StatusCode, http_status: int | None = None) -> None:
        if self._counted:
            return
        self._counted = True
        count_grpc(self.method, code.name)
        if http_status is not None and 400 <= http_status < 500 and http_status != 499:
            REJECTED.labels(reject_reason(http_status)).inc()


async def fail(context: grpc.aio.ServicerContext, call: GrpcCall, err: ApiError) -> NoReturn:
    """End the call with ``err``'s status and message (raises, as ``context.abort`` does)."""
    code = grpc_code(err.status)
    call.done(code, err.status)
    if code is grpc.StatusCode.INTERNAL:
        log.error("gRPC %s failed: %s", call.method, err.message)
    await context.abort(code, err.message)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def abort_later(abort: Callable[[str], Awaitable[Any]], engine_id: str, tasks: set[asyncio.Task[Any]]) -> None:
    """Abort ``engine_id`` in the background: a stream cancelled while suspended at a write leaves the engine's
    generator suspended, not cancelled. ``tasks`` holds the task until it ends (asyncio keeps only weak references)."""
    task = asyncio.ensure_future(abort(engine_id))
    tasks.add(task)
    task.add_done_callback(tasks.discard)
