"""``POST /inference/v1/generate``: vLLM 0.32's token-in/token-out API, JSON and SSE.

Hot path: the body is validated by pydantic-core straight from bytes, answers are plain dicts serialized by orjson,
and streamed chunks are built without per-token models.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response, StreamingResponse

from app.core.multimodal import MultimodalPrompt, multimodal_prompt
from app.core.protocol import (
    ERROR_RESPONSES,
    ApiError,
    GenerateRequest,
    GenerateResponse,
    bad_request,
    parse_json_body,
)
from app.engine.sampling import build_sampling_params, check_prompt
from app.server.reqlog import set_request_id
from app.server.state import AppState, get_state

if TYPE_CHECKING:
    from app.engine.adapter import CompletionOutput, RequestOutput

log = logging.getLogger("tito.generate")
router = APIRouter(tags=["generate"])

_JSON = "application/json"
_FLOOR = -9999.0
_GENERATE_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {_JSON: {"schema": {"$ref": "#/components/schemas/GenerateRequest"}}},
    }
}


def _clamp(x: float) -> float:
    # -inf and NaN are not JSON; vLLM sends -9999.0 for both.
    return _FLOOR if math.isnan(x) or x < _FLOOR else x


def _token_entry(token_id: int, lp: Any) -> dict[str, Any]:
    # Both generations of clients: vLLM 0.32 reads token_id; renderers (Prime-RL) and vLLM <= 0.31 read
    # "token": "token_id:<id>" with bytes null.
    return {"token_id": token_id, "token": f"token_id:{token_id}", "logprob": _clamp(lp.logprob),
            "rank": lp.rank or None, "bytes": None}


def logprobs_content(token_ids: Any, top: Any, num: int) -> dict[str, Any]:
    content = []
    for i, tid in enumerate(token_ids):
        step = top[i] if top is not None and i < len(top) else None
        lp = step.get(tid) if step is not None else None
        if step is None or lp is None:
            content.append({"token_id": tid, "token": f"token_id:{tid}", "logprob": _FLOOR, "rank": None,
                            "bytes": None, "top_logprobs": []})
            continue
        entry = _token_entry(tid, lp)
        k = len(step) if num == -1 else max(num, 1)
        entry["top_logprobs"] = [_token_entry(t, v) for j, (t, v) in enumerate(step.items()) if j < k]
        content.append(entry)
    return {"content": content}


def prompt_logprobs_json(plp: Any) -> list[Any] | None:
    if plp is None:
        return None
    out: list[Any] = []
    for step in plp:
        if step is None:
            out.append(None)
        else:
            out.append({str(t): {"logprob": _clamp(v.logprob), "rank": v.rank, "decoded_token": None}
                        for t, v in step.items()})
    return out


def _spans(output: CompletionOutput) -> list[dict[str, Any]] | None:
    wv = output.weight_versions
    if wv is None:
        return None
    return [{"version": s.version, "start": s.start, "end": s.end} for s in wv]


def _choice(output: CompletionOutput, num_logprobs: int | None, *, final: bool) -> dict[str, Any]:
    return {
        "index": output.index,
        "finish_reason": (output.finish_reason or "stop") if final else output.finish_reason,
        "stop_reason": output.stop_reason,
        "token_ids": list(output.token_ids),
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": _spans(output),
        "logprobs": (logprobs_content(output.token_ids, output.logprobs, num_logprobs)
                     if num_logprobs is not None else None),
    }


def _usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached} if cached is not None else None,
            "completion_tokens_details": None}


def _dp_rank(request: Request, dp_size: int) -> int | None:
    raw = request.headers.get("x-data-parallel-rank")
    if raw is None:
        return None
    try:
        rank = int(raw)
    except ValueError:
        raise bad_request(f"X-data-parallel-rank must be an integer, got {raw!r}.", "X-data-parallel-rank") from None
    if not 0 <= rank < dp_size:
        raise bad_request(f"X-data-parallel-rank {rank} is out of range [0, {dp_size}).", "X-data-parallel-rank")
    return rank


def _engine_error(state: AppState, e: BaseException) -> ApiError:
    return state.engine_error(e, "generation", param_prefix="sampling_params.")


async def _parse(request: Request, state: AppState) -> GenerateRequest:
    ctype = request.headers.get("content-type", "")
    if not ctype.split(";", 1)[0].strip().lower() == _JSON:
        raise ApiError(400, f"Content-Type must be application/json, got {ctype or 'none'!r}.")
    body = await request.body()
    if len(body) > state.settings.max_body_bytes:
        raise ApiError(413, f"request body of {len(body)} bytes exceeds the limit of "
                            f"{state.settings.max_body_bytes} bytes.")
    return parse_json_body(GenerateRequest, body)


@router.post("/inference/v1/generate", response_model=GenerateResponse, responses=ERROR_RESPONSES,
             openapi_extra=_GENERATE_SCHEMA, summary="Token-in/token-out generation (vLLM 0.32 wire)")
async def generate(request: Request, state: AppState = Depends(get_state)) -> Response:
    req = await _parse(request, state)
    state.admit()
    lora = state.resolve_model(req.model)
    check_prompt(req.token_ids, state.limits)
    params = build_sampling_params(req, state.limits)
    dp_rank = _dp_rank(request, state.facts.data_parallel_size)
    base_id = request.headers.get("x-request-id") or req.request_id or uuid.uuid4().hex
    request_id = f"generate-tokens-{base_id}"
    set_request_id(request.scope, request_id)  # log lines about this request carry its id
    salt = req.cache_salt or req.sampling_params.cache_salt
    return_ids = bool(req.return_token_ids or req.sampling_params.return_token_ids)
    model_name = req.model if lora is not None else state.facts.name
    num_lp = params.logprobs
    # None unless content_parts / features (app/core/multimodal.py).
    mm = await multimodal_prompt(state, req, params, salt)

    # The engine sees a unique id (clients may share theirs); the answer carries the client's, as vLLM's does.
    engine_id = state.enter(request_id)
    try:
        gen = state.engine.generate(req.token_ids, params, engine_id, cache_salt=salt, lora=lora,
                                    priority=req.priority, data_parallel_rank=dp_rank,
                                    prompt=mm.engine_input if mm else None)
    except BaseException:
        state.leave(engine_id)
        raise

    if req.stream:
        return _SseResponse(_Stream(state, gen, request_id, engine_id, req, params.n, num_lp, return_ids, mm))

    try:
        final = await _collect_or_disconnect(request, gen, engine_id, state)
    finally:
        state.leave(engine_id)
    body = {
        "request_id": request_id,
        "model": model_name,
        "created": int(time.time()),
        "usage": _usage(len(final.prompt_token_ids or req.token_ids),
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
        "choices": [_choice(o, num_lp, final=True) for o in sorted(final.outputs, key=lambda o: o.index)],
    }
    return Response(orjson.dumps(body), media_type=_JSON, headers={"X-Engine-Request-Id": engine_id})


async def _collect_or_disconnect(request: Request, gen: AsyncIterator[RequestOutput], request_id: str,
                                 state: AppState) -> RequestOutput:
    """Run the generation in this task while one watcher listens for the client going away; a disconnect cancels
    this task (AsyncLLM aborts the engine request on cancellation) and answers 499.

    One helper task per request rather than two (a collector and a watcher joined with ``asyncio.wait``): that
    costs a task, a wait set and a wake-up less on every request."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    final = None
    try:
        async for out in gen:
            final = out
    except asyncio.CancelledError:
        if not gone:
            raise  # the server is shutting down: not ours to swallow
        task.uncancel()
        await state.engine.abort(request_id)
        log.info("client disconnected; aborted %s", request_id)
        raise ApiError(499, "client disconnected") from None
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001 - mapped to an error answer, never a hang or a bare 500
        raise _engine_error(state, e) from None
    finally:
        watcher.cancel()  # no await since the loop ended: the watcher cannot cancel us after this
    if final is None:
        raise ApiError(500, "engine returned no output")
    return final


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"
_IDS_MARK = b'"token_ids":[]'


def _plain_event_parts(request_id: str, index: int) -> tuple[bytes, bytes]:
    """The bytes of a plain mid-stream event (tokens only: no finish, logprobs or usage; the bulk of a stream) before
    and after its token ids. Cut out of the general form built by ``_choice``, so the two cannot differ."""
    blank = SimpleNamespace(index=index, finish_reason=None, stop_reason=None, token_ids=[], weight_versions=None,
                            logprobs=None)
    whole = _sse({"request_id": request_id, "usage": None, "output_mode": "tokens",
                  "choices": [_choice(blank, None, final=False)]})  # type: ignore[arg-type]
    head, mark, tail = whole.partition(_IDS_MARK)
    assert mark and _IDS_MARK not in tail
    return head + b'"token_ids":', tail


class _Stream:
    """One streamed answer: turns the engine's delta outputs into SSE chunks and owns the request's in-flight slot,
    released exactly once: by the stream when it runs, or by ``_SseResponse`` when the client left before it did."""

    __slots__ = ("state", "gen", "request_id", "engine_id", "prompt_len", "n", "num_lp", "include_usage", "continuous",
                 "prompt_ids", "mm_placeholders", "started")

    def __init__(self, state: AppState, gen: AsyncIterator[RequestOutput], request_id: str, engine_id: str,
                 req: GenerateRequest, n: int, num_lp: int | None, return_ids: bool,
                 mm: MultimodalPrompt | None = None) -> None:
        # request_id is what the client sees; engine_id the request's own id in the engine and in AppState.live.
        self.state, self.gen, self.request_id, self.engine_id = state, gen, request_id, engine_id
        self.prompt_len, self.n, self.num_lp = len(req.token_ids), n, num_lp
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous = bool(self.include_usage and opts and opts.continuous_usage_stats)
        # Sent once, in the first chunk (a multimodal prompt as the engine saw it, placeholders expanded).
        prompt_ids = mm.engine_input["prompt_token_ids"] if mm else req.token_ids
        self.prompt_ids: list[int] | None = prompt_ids if return_ids else None
        self.mm_placeholders: dict[str, Any] | None = mm.placeholders if mm else None
        self.started = False

    def release_unstarted(self) -> None:
        if not self.started:
            self.started = True
            self.state.leave(self.engine_id)

    async def events(self) -> AsyncIterator[bytes]:
        if self.started:  # _SseResponse already gave up on this stream
            return
        self.started = True
        state, request_id, prompt_len, num_lp, continuous = (self.state, self.request_id, self.prompt_len,
                                                             self.num_lp, self.continuous)
        prompt_ids, mm_placeholders = self.prompt_ids, self.mm_placeholders
        generated = [0] * self.n
        # Per choice index: the byte template of its plain events, made at its first one (see _plain_event_parts).
        plain: list[tuple[bytes, bytes] | None] | None = None if num_lp is not None or continuous else [None] * self.n
        cached: int | None = None
        finished = False
        try:
            first = True
            async for res in self.gen:
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
                            and prompt_ids is None and mm_placeholders is None):
                        parts = plain[i] or _plain_event_parts(request_id, i)
                        plain[i] = parts
                        yield parts[0] + orjson.dumps(out.token_ids) + parts[1]
                        continue
                    chunk: dict[str, Any] = {"request_id": request_id, "usage": None, "output_mode": "tokens",
                                             "choices": [_choice(out, num_lp, final=False)]}
                    if prompt_ids is not None:
                        chunk["prompt_token_ids"] = prompt_ids
                        prompt_ids = None
                    if mm_placeholders is not None:  # first chunk only, as vLLM sends it
                        chunk["mm_placeholders"] = mm_placeholders
                        mm_placeholders = None
                    if continuous:
                        chunk["usage"] = {"prompt_tokens": prompt_len, "completion_tokens": generated[i],
                                          "total_tokens": prompt_len + generated[i]}
                    yield _sse(chunk)
            if self.include_usage:
                total = sum(generated)
                usage: dict[str, Any] = {"prompt_tokens": prompt_len, "total_tokens": prompt_len + total,
                                         "completion_tokens": total}
                if cached is not None:
                    usage["prompt_tokens_details"] = {"cached_tokens": cached}
                yield _sse({"request_id": request_id, "usage": usage, "output_mode": "tokens", "choices": []})
            finished = True
        except Exception as e:  # noqa: BLE001 - any failure becomes an error event; the status is already 200
            finished = True
            err = e if isinstance(e, ApiError) else _engine_error(state, e)
            yield _sse(err.body())
        finally:
            state.leave(self.engine_id)
            if not finished:
                # Client went away mid-stream (we were closed or cancelled at a yield): the engine generator is
                # suspended and would only abort when garbage-collected, so abort the request now.
                _background(state.engine.abort(self.engine_id))
        yield _DONE


class _SseResponse(StreamingResponse):
    """The SSE answer, sent by a lean ASGI loop rather than Starlette's (which runs the body in an anyio task group,
    with a second task listening for the disconnect): this task sends every event, one watcher task cancels it when
    the client goes away (the stream's ``finally`` then aborts the engine request), and ``[DONE]`` goes out with the
    end of the body in one write. If the client is gone before the body starts, the generator never runs (nor its
    ``finally``): release the in-flight slot here, or a drain would wait for it forever."""

    def __init__(self, stream: _Stream) -> None:
        super().__init__(stream.events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  "X-Engine-Request-Id": stream.engine_id})
        self._stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        events = self.body_iterator
        done = gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not done:  # not the disconnect that the end of the answer itself reports
                gone = True
                task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in events:
                done = chunk is _DONE  # always the stream's last event
                await send({"type": "http.response.body", "body": chunk, "more_body": not done})
            if not done:
                done = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise  # the server is shutting down: not ours to swallow
            task.uncancel()  # the client left: the stream's finally has aborted its engine request
        finally:
            done = True
            watcher.cancel()
            await events.aclose()  # type: ignore[attr-defined]
            self._stream.release_unstarted()


_tasks: set[asyncio.Task[Any]] = set()


def _background(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    _tasks.add(task)  # keep a reference until done, or the loop may drop it
    task.add_done_callback(_tasks.discard)
