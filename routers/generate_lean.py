"""The generate route's lean path: ``POST /inference/v1/generate`` as one ASGI callable in front of the FastAPI app
(tito/main.py ``TitoApp``), doing what the middleware stack and FastAPI's routing do for that route.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from app.core.metrics import count_answer
from app.core.protocol import GENERATE_PATH, ApiError, content_length_refusal, send_api_error
from app.server.security import Keys, Plane, refusal, send_unauthorized
from app.server.state import AppState, not_started_app
from routers.generate import Out, serve_generate


class Lean:
    """``POST /inference/v1/generate`` as one ASGI callable in front of the FastAPI app (tito/main.py ``TitoApp``):
    what the middleware stack and FastAPI's routing did for this route, in the same order and with the same answers,
    with none of their per-request layers (request counter, API key, body limit, exception wrappers, routing,
    dependency injection, ``Request``/``Response`` objects). tests/test_http_bytes.py holds both paths to the same
    bytes and counters."""

    def __init__(self, app: Any) -> None:
        settings = app.state.settings
        self.app = app
        self.keys = Keys.from_settings(settings)
        self.limit: int = settings.max_body_bytes
        self.state: AppState | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = _Counted(send)
        try:
            if self.keys.any:
                message = refusal(self.keys, scope, Plane.DATA)
                if message is not None:
                    answer.route = "unmatched"
                    await send_unauthorized(answer.sender(), message)
                    return
            for k, v in scope["headers"]:
                if k == b"content-length":
                    refused = content_length_refusal(v, self.limit)
                    if refused is not None:
                        answer.route = "unmatched"
                        await send_api_error(answer.sender(), refused)
                        return
                    break
            state = self.state
            if state is None:
                state = self.state = getattr(self.app.state, "tito", None)
                if state is None:
                    raise not_started_app(self.app)
            await serve_generate(state, scope, receive, answer)
        except ApiError as e:
            if answer.started:
                raise
            await send_api_error(answer.sender(), e)
        except Exception as e:
            if not answer.started:
                # What FastAPI's handler of last resort answers (tito/main.py): no stack trace reaches the client.
                logging.getLogger("tito").error("unhandled error", exc_info=e)
                answer.status = 500
                await send_api_error(answer.sender(), ApiError(500, f"internal error: {type(e).__name__}"))
            raise
        finally:
            answer.close()


class _Counted(Out):
    """The lean path's request counter (``RequestMetrics`` in the stack): counts the answer just before its last
    message goes out (a client that has its answer and scrapes /metrics finds it counted), or as the request ends
    without one, under the route's label, or "unmatched" for what the middleware answered before routing."""

    __slots__ = ("raw", "route", "status", "started", "done")

    def __init__(self, send: Send) -> None:
        self.raw = self.send = send
        self.start, self.last = self._start, self._last
        self.route, self.status, self.started, self.done = GENERATE_PATH, 500, False, False

    async def _start(self, message: Message) -> None:
        self.status, self.started = int(message["status"]), True
        await self.raw(message)

    async def _last(self, message: Message) -> None:
        self.close()
        await self.raw(message)

    def sender(self) -> Send:
        """A plain ``send`` for a whole answer of a few messages (errors)."""

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                await self._start(message)
            elif not message.get("more_body", False):
                await self._last(message)
            else:
                await self.raw(message)

        return send

    def close(self) -> None:
        if not self.done:
            self.done = True
            count_answer(self.route, self.status)
