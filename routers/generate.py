"""``POST /inference/v1/generate``: vLLM 0.32's token-in/token-out API, JSON and SSE.

Hot path: the route runs as one lean ASGI callable in front of FastAPI (routers/generate_lean.py), the body is
validated by pydantic-core straight from bytes, answers are plain dicts serialized by orjson
(routers/generate_wire.py), and streamed events are spliced from a byte template and written straight to the server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Depends, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from app.core.multimodal import MultimodalPrompt, multimodal_prompt
from app.core.protocol import (
    ERROR_RESPONSES,
    GENERATE_PATH,
    ApiError,
    GenerateRequest,
    GenerateResponse,
    header_value,
    parse_json_body,
    status_phrase,
)
from app.engine.sampling import build_sampling_params, check_prompt
from app.server.reqlog import set_request_id
from app.server.requests import Disconnect, data_parallel_rank
from app.server.state import AppState, get_state
from routers.generate_wire import DONE, choice, plain_event_parts, prompt_logprobs_json, sse, usage

if TYPE_CHECKING:
    from app.engine.adapter import RequestOutput

log = logging.getLogger("tito.generate")
router = APIRouter(tags=["generate"])

_JSON = "application/json"
_JSON_TYPE = (b"content-type", b"application/json")
_SSE_HEAD = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_SSE_TYPE = (b"content-type", b"text/event-stream; charset=utf-8")
_GENERATE_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {_JSON: {"schema": {"$ref": "#/components/schemas/GenerateRequest"}}},
    }
}


def _uuid4_hex() -> str:
    """``uuid.uuid4().hex``, the same random version-4 form, without building a ``UUID`` (a fifth of the cost)."""
    b = bytearray(os.urandom(16))
    b[6] = b[6] & 0x0F | 0x40  # version 4
    b[8] = b[8] & 0x3F | 0x80  # RFC 4122 variant
    return b.hex()


def _engine_error(state: AppState, e: BaseException) -> ApiError:
    return state.engine_error(e, "generation", param_prefix="sampling_params.")


class _Head:
    """The request headers the route reads, in one pass over the ASGI list; the first of each, as Starlette's
    ``Headers.get`` gives it."""

    __slots__ = ("content_type", "request_id", "dp_rank")

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.content_type = self.request_id = self.dp_rank = None
        for k, v in headers:
            if k == b"content-type":
                if self.content_type is None:
                    self.content_type = v.decode("latin-1")
            elif k == b"x-request-id":
                if self.request_id is None:
                    self.request_id = v.decode("latin-1")
            elif k == b"x-data-parallel-rank" and self.dp_rank is None:
                self.dp_rank = v.decode("latin-1")


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; over ``limit`` while it arrives (a chunked body: no Content-Length was checked) is a
    413 as the body limit words it, a disconnect before its end is Starlette's ``ClientDisconnect``."""
    first = await receive()
    if first["type"] == "http.request" and not first.get("more_body", False):
        body: bytes = first.get("body", b"")
        if len(body) > limit:
            raise _chunked_too_large(limit)
        return body
    chunks: list[bytes] = []
    seen = 0
    msg = first
    while True:
        if msg["type"] == "http.request":
            piece = msg.get("body", b"")
            seen += len(piece)
            if seen > limit:
                raise _chunked_too_large(limit)
            chunks.append(piece)
            if not msg.get("more_body", False):
                return b"".join(chunks)
        elif msg["type"] == "http.disconnect":
            raise ClientDisconnect()
        msg = await receive()


def _chunked_too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body exceeds the limit of {limit} bytes.", type=status_phrase(413))


class Out:
    """Where ``serve_generate`` sends its answer: ``send`` for the messages in the middle, ``start`` and ``last`` for
    the first and the last. Behind the middleware stack all three are its ``send``; the lean path (generate_lean)
    counts the request in ``last`` rather than wrapping every message (an SSE answer is one message per engine
    step)."""

    __slots__ = ("send", "start", "last")

    def __init__(self, send: Send) -> None:
        self.send = self.start = self.last = send


async def serve_generate(state: AppState, scope: Scope, receive: Receive, out: Out) -> None:
    """The route, once the request is past the key check and the Content-Length limit: parse, check, run the engine
    request, answer. Failures before the answer starts raise (``ApiError``: the caller answers it)."""
    head = _Head(scope["headers"])
    ctype = head.content_type or ""
    if not ctype.split(";", 1)[0].strip().lower() == _JSON:
        raise ApiError(400, f"Content-Type must be application/json, got {ctype or 'none'!r}.")
    limit = state.settings.max_body_bytes
    body = await read_body(receive, limit)
    if len(body) > limit:
        raise ApiError(413, f"request body of {len(body)} bytes exceeds the limit of {limit} bytes.")
    req = parse_json_body(GenerateRequest, body)
    state.admit()
    lora = state.resolve_model(req.model)
    check_prompt(req.token_ids, state.limits)
    params = build_sampling_params(req, state.limits)
    dp_rank = data_parallel_rank(head.dp_rank, state.facts.data_parallel_size)
    base_id = head.request_id or req.request_id or _uuid4_hex()
    request_id = f"generate-tokens-{base_id}"
    set_request_id(scope, request_id)  # log lines about this request carry its id
    salt = req.cache_salt or req.sampling_params.cache_salt
    return_ids = bool(req.return_token_ids or req.sampling_params.return_token_ids)
    model_name = req.model if lora is not None else state.facts.name
    num_lp = params.logprobs
    # None unless content_parts / features (app/core/multimodal.py).
    mm = await multimodal_prompt(state, req, params, salt) if req.content_parts or req.features is not None \
        else None

    # The engine sees a unique id (clients may share theirs); the answer carries the client's, as vLLM's does.
    engine_id = state.enter(request_id)
    try:
        gen = state.engine.generate(req.token_ids, params, engine_id, cache_salt=salt, lora=lora,
                                    priority=req.priority, data_parallel_rank=dp_rank,
                                    prompt=mm.engine_input if mm else None)
        if req.stream:
            stream = _Stream(state, gen, request_id, engine_id, req, params.n, num_lp, return_ids, mm)
    except BaseException:
        state.leave(engine_id)
        raise
    if req.stream:
        await stream.send(receive, out)
        return

    try:
        final = await _collect_or_disconnect(receive, gen, engine_id, state)
    finally:
        state.leave(engine_id)
    answer = {
        "request_id": request_id,
        "model": model_name,
        "created": int(time.time()),
        "usage": usage(len(final.prompt_token_ids or req.token_ids),
                        sum(len(o.token_ids) for o in final.outputs), final.num_cached_tokens),
        "prompt_logprobs": prompt_logprobs_json(final.prompt_logprobs),
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": list(final.prompt_token_ids or req.token_ids) if return_ids else None,
        "mm_placeholders": mm.placeholders if mm else None,
        "metrics": None,
        # Echo the request's params when no KV connector produced its own (the contract for P/D clients).
        "kv_transfer_params": (final.kv_transfer_params if final.kv_transfer_params is not None
                               else req.kv_transfer_params),
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [choice(o, num_lp, final=True, experts=experts_form(state, req))
                    for o in sorted(final.outputs, key=lambda o: o.index)],
    }
    data = orjson.dumps(answer)
    # Starlette's Response(media_type=JSON, headers={"X-Engine-Request-Id": ...}) headers, in its order.
    headers = [(b"x-engine-request-id", header_value(engine_id).encode("latin-1")),
               (b"content-length", b"%d" % len(data)), _JSON_TYPE]
    await out.start({"type": "http.response.start", "status": 200, "headers": headers})
    await out.last({"type": "http.response.body", "body": data})


@router.post(GENERATE_PATH, response_model=GenerateResponse, responses=ERROR_RESPONSES,
             openapi_extra=_GENERATE_SCHEMA, summary="Token-in/token-out generation (vLLM 0.32 wire)")
async def generate(request: Request, state: AppState = Depends(get_state)) -> Response:
    """The route as mounted in FastAPI: the OpenAPI entry, and what serves it when the lean path (generate_lean) is off
    (a middleware added after ``create_app``). The answer is ``serve_generate`` run as the response."""
    return _Served(state)


class _Served(Response):
    def __init__(self, state: AppState) -> None:  # noqa: D107 - no body of its own: serve_generate sends it
        self.state = state
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_generate(self.state, scope, receive, Out(send))


async def _collect_or_disconnect(receive: Receive, gen: AsyncIterator[RequestOutput], request_id: str,
                                 state: AppState) -> RequestOutput:
    """Run the generation in this task while a ``Disconnect`` watcher listens for the client going away; a disconnect
    cancels this task (AsyncLLM aborts the engine request on cancellation) and answers 499."""
    watch = Disconnect(receive)
    final = None
    try:
        async for out in gen:
            final = out
    except asyncio.CancelledError:
        if not watch.left():
            raise  # the server is shutting down: not ours to swallow
        await state.engine.abort(request_id)
        log.info("client disconnected; aborted %s", request_id)
        raise ApiError(499, "client disconnected") from None
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001 - mapped to an error answer, never a hang or a bare 500
        raise _engine_error(state, e) from None
    finally:
        watch.stop()
    if final is None:
        raise ApiError(500, "engine returned no output")
    return final


def experts_form(state: AppState, req: GenerateRequest) -> tuple[int, str]:
    """Where the routed experts' rows start (the request's ``routed_experts_prompt_start``) and their wire form."""
    return int(req.sampling_params.routed_experts_prompt_start or 0), state.settings.routed_experts_format


class _Stream:
    """One streamed answer: turns the engine's delta outputs into SSE events and sends them, and owns the request's
    in-flight slot (released exactly once, however the stream ends)."""

    __slots__ = ("state", "gen", "request_id", "engine_id", "prompt_len", "n", "num_lp", "include_usage", "continuous",
                 "prompt_ids", "mm_placeholders", "started", "experts")

    def __init__(self, state: AppState, gen: AsyncIterator[RequestOutput], request_id: str, engine_id: str,
                 req: GenerateRequest, n: int, num_lp: int | None, return_ids: bool,
                 mm: MultimodalPrompt | None = None) -> None:
        # request_id is what the client sees; engine_id the request's own id in the engine and in AppState.live.
        self.state, self.gen, self.request_id, self.engine_id = state, gen, request_id, engine_id
        self.prompt_len, self.n, self.num_lp = len(req.token_ids), n, num_lp
        self.experts = experts_form(state, req)
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous = bool(self.include_usage and opts and opts.continuous_usage_stats)
        # Sent once, in the first chunk (a multimodal prompt as the engine saw it, placeholders expanded).
        prompt_ids = mm.engine_input["prompt_token_ids"] if mm else req.token_ids
        self.prompt_ids: list[int] | None = prompt_ids if return_ids else None
        self.mm_placeholders: dict[str, Any] | None = mm.placeholders if mm else None

    async def send(self, receive: Receive, out: Out) -> None:
        """Send the answer: headers, one event per engine output (as soon as it comes), the error event of a failure,
        then ``[DONE]``; the last output's events and the usage event go out with ``[DONE]`` and the end of the body,
        in one write. One watcher task cancels this one when the client goes
        away; the engine request is then aborted. If the client is gone before the body starts, the engine request
        never starts (vLLM's generator is lazy) and the in-flight slot is still released."""
        watch = Disconnect(receive)
        held = True  # the in-flight slot
        try:
            # StreamingResponse's headers, in its order; the id is encoded first: a failure there answers 500.
            headers = [*_SSE_HEAD, (b"x-engine-request-id", header_value(self.engine_id).encode("latin-1")),
                       _SSE_TYPE]
            await out.start({"type": "http.response.start", "status": 200, "headers": headers})
            held = False
            tail = await self._events(out.send)
            watch.ending = True  # the disconnect that the end of the answer itself reports is not the client leaving
            await out.last({"type": "http.response.body", "body": tail + DONE, "more_body": False})
        except asyncio.CancelledError:
            if not watch.left():
                raise  # the server is shutting down: not ours to swallow
            # the client left: _events has aborted its engine request
        finally:
            watch.stop()
            if held:
                self.state.leave(self.engine_id)

    async def _events(self, send: Send) -> bytes:
        """Every event before ``[DONE]``: sends them, except those of the engine's last output and the usage event,
        which it returns (they go out with ``[DONE]``). Releases the in-flight slot as the engine request ends (or is
        abandoned)."""
        state, request_id, prompt_len, num_lp, continuous = (self.state, self.request_id, self.prompt_len,
                                                             self.num_lp, self.continuous)
        prompt_ids, mm_placeholders = self.prompt_ids, self.mm_placeholders
        generated = [0] * self.n
        # Per choice index: the byte template of its plain events, made at its first one (plain_event_parts).
        plain: list[tuple[bytes, bytes] | None] | None = None if num_lp is not None or continuous else [None] * self.n
        cached: int | None = None
        finished = False
        tail: list[bytes] = []
        try:
            first = True
            async for res in self.gen:
                if res.finished:
                    send = _keep(tail)
                if first:
                    cached = res.num_cached_tokens
                    if res.prompt_token_ids is not None:
                        prompt_len = len(res.prompt_token_ids)
                    first = False
                for out in res.outputs:
                    i = out.index
                    generated[i] += len(out.token_ids)
                    # Terminal outputs are always sent (an abort may carry no tokens) so the client sees the reason.
                    if not out.token_ids and out.finish_reason is None:
                        continue
                    if (plain is not None and out.finish_reason is None and out.weight_versions is None
                            and prompt_ids is None and mm_placeholders is None
                            and getattr(out, "sampling_mask", None) is None
                            and getattr(out, "routed_experts", None) is None):
                        parts = plain[i] or plain_event_parts(request_id, i)
                        plain[i] = parts
                        await send({"type": "http.response.body", "body": parts[0] + orjson.dumps(out.token_ids)
                                    + parts[1], "more_body": True})
                        continue
                    chunk: dict[str, Any] = {"request_id": request_id, "usage": None, "output_mode": "tokens",
                                             "choices": [choice(out, num_lp, final=False,
                                                                experts=self.experts)]}
                    if prompt_ids is not None:
                        chunk["prompt_token_ids"] = prompt_ids
                        prompt_ids = None
                    if mm_placeholders is not None:  # first chunk only, as vLLM sends it
                        chunk["mm_placeholders"] = mm_placeholders
                        mm_placeholders = None
                    if continuous:
                        chunk["usage"] = {"prompt_tokens": prompt_len, "completion_tokens": generated[i],
                                          "total_tokens": prompt_len + generated[i]}
                    await send({"type": "http.response.body", "body": sse(chunk), "more_body": True})
            if self.include_usage:
                total = sum(generated)
                totals: dict[str, Any] = {"prompt_tokens": prompt_len, "total_tokens": prompt_len + total,
                                          "completion_tokens": total}
                if cached is not None:
                    totals["prompt_tokens_details"] = {"cached_tokens": cached}
                tail.append(sse({"request_id": request_id, "usage": totals, "output_mode": "tokens", "choices": []}))
            finished = True
        except Exception as e:  # noqa: BLE001 - any failure becomes an error event; the status is already 200
            finished = True
            err = e if isinstance(e, ApiError) else _engine_error(state, e)
            tail.append(sse(err.body()))
        finally:
            state.leave(self.engine_id)
            if not finished:
                # Client went away mid-stream (we were cancelled at an await): the engine generator is suspended
                # and would only abort when garbage-collected, so abort the request now.
                _background(state.engine.abort(self.engine_id))
        return b"".join(tail)


def _keep(tail: list[bytes]) -> Send:
    """A ``send`` that keeps the events' bytes for the answer's last write instead of sending them."""

    async def keep(message: Message) -> None:
        tail.append(message["body"])

    return keep


_tasks: set[asyncio.Task[Any]] = set()


def _background(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    _tasks.add(task)  # keep a reference until done, or the loop may drop it
    task.add_done_callback(_tasks.discard)
