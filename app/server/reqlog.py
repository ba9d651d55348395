"""Request logging: one line per HTTP request (``--log-requests``) and the request id on every log line about it.

Zero cost when off: the middleware is only mounted with ``--log-requests``; the filter that copies the request id
into log records only runs for lines that are actually emitted.

The id of a request is, in order: what the generate route chose (``generate-tokens-<id>``, put in the ASGI scope
under ``SCOPE_KEY``), the client's ``X-Request-Id`` header, or a fresh random id. It is held in a context variable
while the request runs, so any ``log.info(...)`` made on its behalf carries it as ``record.request_id``.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextvars import ContextVar

from starlette.types import Message, Receive, Scope, Send

from app.core.metrics import HttpMiddleware, StatusSend

REQUEST_ID: ContextVar[str | None] = ContextVar("tito_request_id", default=None)
SCOPE_KEY = "tito.request_id"

log = logging.getLogger("tito.request")


def set_request_id(scope: Scope, request_id: str) -> None:
    """Called by a route that knows the request's real id (generate): later log lines and the access line use it."""
    scope[SCOPE_KEY] = request_id
    REQUEST_ID.set(request_id)


class RequestIdFilter(logging.Filter):
    """Give every record a ``request_id`` attribute: the explicit ``extra=``, else the current request's, else None."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return str(v.decode("latin-1"))
    return None


class RequestLog(HttpMiddleware):
    """Pure-ASGI middleware: after each request, ``METHOD /path STATUS 12.3ms`` at info, with its request id."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        rid = _header(scope, b"x-request-id") or uuid.uuid4().hex
        token = REQUEST_ID.set(rid)
        watched = StatusSend(send, 0)
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, watched)
        except BaseException:
            watched.status = watched.status or 500
            raise
        finally:
            ms = (time.perf_counter() - t0) * 1000.0
            path = scope.get("path", "")
            if scope.get("query_string"):
                path += "?" + scope["query_string"].decode("latin-1")
            client = scope.get("client")
            log.info("%s %s %d %.1fms %s", scope.get("method", "?"), path, watched.status, ms,
                     client[0] if client else "-", extra={"request_id": scope.get(SCOPE_KEY) or rid})
            REQUEST_ID.reset(token)


class RequestIdHeader(HttpMiddleware):
    """vLLM's ``--enable-request-id-headers``: every answer carries ``X-Request-Id`` (the client's, else a new one)."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        rid = (_header(scope, b"x-request-id") or uuid.uuid4().hex).encode("latin-1")

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, with_id)
