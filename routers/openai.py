"""vLLM's OpenAI routes: ``POST /v1/completions``, ``/v1/chat/completions`` (+ ``/render``), ``/tokenize``,
``/detokenize``, served by vLLM's own handlers (through the engine adapter, app/engine/openai_layer.py) behind tito's
admission, body limits, validation and in-flight accounting, as the token API.

Token-id prompts work on every server; text prompts, chat and (de)tokenization need the model's tokenizer (400
otherwise). Not the RL hot path (that is /inference/v1/generate): answers are vLLM's models, dumped as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from app.core.protocol import ERROR_RESPONSES, ApiError, header_value
from app.engine.openai_layer import Answer, Gate
from app.server.reqlog import set_request_id
from app.server.requests import DP_RANK_HEADER, Disconnect, data_parallel_rank
from app.server.state import AppState, get_state

log = logging.getLogger("tito.openai")
router = APIRouter(tags=["openai"])

_JSON = "application/json"


def _body_schema(name: str) -> dict[str, Any]:
    # The handlers parse their bodies themselves (vLLM's models, from bytes); the schema says what they take.
    return {"requestBody": {"required": True, "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{name}"}}}}}


async def _body(request: Request, state: AppState) -> bytes:
    ctype = request.headers.get("content-type", "")
    if ctype.split(";", 1)[0].strip().lower() != _JSON:
        raise ApiError(400, f"Content-Type must be application/json, got {ctype or 'none'!r}.")
    body = await request.body()
    if len(body) > state.settings.max_body_bytes:
        raise ApiError(413, f"request body of {len(body)} bytes exceeds the limit of "
                            f"{state.settings.max_body_bytes} bytes.")
    return body


def _gate(request: Request, state: AppState) -> Gate:
    return Gate(limits=state.limits, enter=state.enter, leave=state.leave,
                name=lambda rid: set_request_id(request.scope, rid))


def _json(answer: Answer) -> Response:
    headers = {"X-Engine-Request-Id": header_value(",".join(answer.engine_ids))} if answer.engine_ids else None
    # vLLM dumps prompt_logprobs with integer keys (its JSON encoder makes them strings; so does OPT_NON_STR_KEYS).
    return Response(orjson.dumps(answer.body, option=orjson.OPT_NON_STR_KEYS), status_code=answer.status,
                    media_type=_JSON, headers=headers)


_SSE_HEAD = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_SSE_TYPE = (b"content-type", b"text/event-stream; charset=utf-8")


class _Sse(Response):
    """The stream, sent by a lean loop instead of Starlette's ``StreamingResponse`` (no task group and its second
    receiver per request; the headers are the same): one watcher cancels the send when the client leaves, and then
    the events' generator is closed (the adapter's stream aborts the engine requests). The release of in-flight
    slots whose generation never started, however it ends."""

    def __init__(self, answer: Answer) -> None:  # noqa: D107 - no body of its own: __call__ sends it
        assert answer.stream is not None
        self.stream = answer.stream
        self.raw_headers = [*_SSE_HEAD, (b"x-engine-request-id", header_value(",".join(answer.engine_ids))
                                         .encode("latin-1")), _SSE_TYPE]
        self.status_code, self.background = 200, None  # FastAPI sets background tasks on what a route returns
        self._close = answer.close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watch = Disconnect(receive)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for data in self.stream:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            watch.ending = True  # the disconnect that the end of the answer itself reports is not the client leaving
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.left():
                raise  # the server is shutting down: not ours to swallow
        except OSError:
            pass  # the client left while being written to (uvicorn's ClientDisconnected)
        finally:
            watch.stop()
            aclose = getattr(self.stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            self._close()


async def _generate(request: Request, state: AppState, kind: str) -> Response:
    body = await _body(request, state)
    state.admit()
    # vLLM ignores a bad header; tito answers 400
    data_parallel_rank(request.headers.get(DP_RANK_HEADER), state.facts.data_parallel_size)
    layer = await state.openai_layer()
    run = getattr(layer, {"completion": "completions", "chat": "chat_completions"}.get(kind, kind))
    answer = await _unless_disconnected(request, state, run(request, body, _gate(request, state)))
    if answer.stream is not None:
        return _Sse(answer)
    return _json(answer)


async def _unless_disconnected(request: Request, state: AppState, aw: Any) -> Answer:
    """Run the call in this task while a watcher listens for the client leaving: then the task is cancelled (vLLM's
    handler, or the generator under it, aborts the engine requests) and the answer is 499. Errors of the engine are
    mapped as the token API maps them."""
    watch = Disconnect(request.receive)
    try:
        answer: Answer = await aw
    except asyncio.CancelledError:
        if not watch.left():
            raise
        raise ApiError(499, "client disconnected") from None
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001 - a dead engine is 503, anything else 500 without a trace
        raise state.engine_error(e, "generation") from None
    finally:
        watch.stop()
    if watch.left():  # vLLM's handler swallowed the cancellation ("Client disconnected")
        answer.close()
        raise ApiError(499, "client disconnected")
    return answer


async def _at_once(request: Request, state: AppState, call: str, *extra: Any) -> Response:
    """Render, (de)tokenize, count tokens: vLLM's handler answers at once and generates nothing, so no admission or
    in-flight slot, but the engine must be alive."""
    body = await _body(request, state)
    state.check_engine()
    return _json(await getattr(await state.openai_layer(), call)(request, body, *extra))


@router.post("/v1/completions", responses=ERROR_RESPONSES, openapi_extra=_body_schema("CompletionRequest"),
             summary="vLLM's completions: token-id prompts (text with a tokenizer), n, logprobs, echo, streaming")
async def completions(request: Request, state: AppState = Depends(get_state)) -> Response:
    return await _generate(request, state, "completion")


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES,
             openapi_extra=_body_schema("ChatCompletionRequest"),
             summary="vLLM's chat completions (needs the model's tokenizer and chat template)")
async def chat_completions(request: Request, state: AppState = Depends(get_state)) -> Response:
    return await _generate(request, state, "chat")


@router.post("/v1/chat/completions/render", responses=ERROR_RESPONSES,
             openapi_extra=_body_schema("ChatCompletionRequest"),
             summary="vLLM's render: a chat as the token request /inference/v1/generate takes (no generation)")
async def render_chat(request: Request, state: AppState = Depends(get_state)) -> Response:
    return await _at_once(request, state, "render_chat")


@router.post("/tokenize", responses=ERROR_RESPONSES, openapi_extra=_body_schema("TokenizeRequest"),
             summary="vLLM's tokenize: text or chat messages to token ids (needs the model's tokenizer)")
async def tokenize(request: Request, state: AppState = Depends(get_state)) -> Response:
    return await _at_once(request, state, "tokenize")


@router.post("/detokenize", responses=ERROR_RESPONSES, openapi_extra=_body_schema("DetokenizeRequest"),
             summary="vLLM's detokenize: token ids to text (needs the model's tokenizer)")
async def detokenize(request: Request, state: AppState = Depends(get_state)) -> Response:
    return await _at_once(request, state, "detokenize", state.limits)


@router.post("/v1/responses", responses=ERROR_RESPONSES,
             summary="vLLM's Responses API (needs the model's tokenizer and chat template)")
async def responses(request: Request, state: AppState = Depends(get_state)) -> Response:
    return await _generate(request, state, "responses")


@router.post("/v1/messages", responses=ERROR_RESPONSES,
             summary="vLLM's Anthropic Messages API (needs the model's tokenizer and chat template)")
async def messages(request: Request, state: AppState = Depends(get_state)) -> Response:
    return await _generate(request, state, "messages")


@router.post("/v1/messages/count_tokens", responses=ERROR_RESPONSES,
             summary="vLLM's Anthropic count_tokens: the prompt's length under the chat template")
async def count_tokens(request: Request, state: AppState = Depends(get_state)) -> Response:
    return await _at_once(request, state, "count_tokens")
