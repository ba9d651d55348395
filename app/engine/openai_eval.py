"""The routes evaluation harnesses call on a vLLM server, through vLLM's own handlers behind tito's gate, as the
completions and chat routes are (``OpenAILayer``): ``/v1/responses`` (OpenAI's Responses API) and ``/v1/messages``,
``/v1/messages/count_tokens`` (Anthropic's Messages API). Their handlers are built on first use. Also the request
schemas of every route of routers/openai.py, for tito's /openapi.json.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import TypeAdapter

from app.engine.openai_layer import Answer, Gate, OpenAILayer, in_call, pick


class EvalLayer(OpenAILayer):
    """``OpenAILayer`` plus vLLM's ``OpenAIServingResponses`` and ``AnthropicServingMessages``."""

    _eval: dict[str, Any] | None = None

    def _eval_handler(self, kind: str) -> Any:
        """Built as vLLM's server builds them, on the gated client and tito's model registry."""
        if self._eval is None:
            self._eval = {}
        if kind not in self._eval:
            client, renderer, c, o = self.completion.engine_client, self.renderer, self.common, self.options
            shared = ("request_logger", "chat_template", "chat_template_content_format", "return_tokens_as_token_ids",
                      "enable_auto_tools", "tool_parser", "tool_strict_level", "reasoning_parser",
                      "enable_prompt_tokens_details", "enable_force_include_usage", "enable_log_outputs",
                      "default_chat_template_kwargs")
            # As vLLM's server builds them (api_router.py), from the same front-end arguments.
            if kind == "responses":
                from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
                from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

                handler: Any = OpenAIServingResponses(client, self.models, renderer, tool_server=None,
                                                      **pick(c, *shared, "enable_per_request_metrics"))
                self._types["responses"] = TypeAdapter(ResponsesRequest)
            else:
                from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
                from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

                handler = AnthropicServingMessages(client, self.models, o.response_role, online_renderer=renderer,
                                                   disabled_thinking_effort=o.anthropic_disabled_thinking_effort,
                                                   **pick(c, *shared, "enable_log_deltas"))
                self._types["messages"] = TypeAdapter(AnthropicMessagesRequest)
                self._types["count_tokens"] = TypeAdapter(AnthropicCountTokensRequest)
            self._eval[kind] = handler
        return self._eval[kind]

    async def responses(self, raw: Any, body: bytes, gate: Gate) -> Answer:
        self._need_tokenizer("/v1/responses (the chat template)")
        handler = self._eval_handler("responses")
        req = self._parse("responses", body)
        call = self._call(gate, "", raw, req.request_id)
        return await self._run_eval(call, handler.create_responses(req, raw), "responses")

    async def messages(self, raw: Any, body: bytes, gate: Gate) -> Answer:
        self._need_tokenizer("/v1/messages (the chat template)")
        handler = self._eval_handler("messages")
        req = self._parse("messages", body)
        call = self._call(gate, "msg-", raw, uuid.uuid4().hex)
        return await self._run_eval(call, handler.create_messages(req, raw), "messages")

    async def count_tokens(self, raw: Any, body: bytes) -> Answer:
        self._need_tokenizer("/v1/messages/count_tokens (the chat template)")
        handler = self._eval_handler("messages")
        req = self._parse("count_tokens", body)
        return eval_answer(await self._guard(handler.count_tokens(req, raw)), "messages")

    async def _run_eval(self, call: Any, aw: Any, kind: str) -> Answer:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        result = await self.gated(call, aw)
        if hasattr(result, "model_dump"):
            call.release()
            answer = eval_answer(result, kind)
            answer.request_id, answer.engine_ids = call.client_id, [s.engine_id for s in call.slots]
            return answer
        events = aiter(result)
        head: list[Any] = []
        # vLLM's Responses stream submits to the engine at its first engine step, not before it returns: read it up
        # to there (its first token) in the call's context, so that tito's checks answer a 4xx before the 200.
        while not call.slots:
            try:
                ev = await self.gated(call, anext(events))
            except StopAsyncIteration:
                break
            if isinstance(ev, ErrorResponse):  # vLLM's error answer (``_guard``): refused, and no 200 sent yet
                call.release()
                return eval_answer(ev, kind)
            head.append(ev)
        return Answer(200, stream=_events(call, head, events), request_id=call.client_id,
                      engine_ids=[s.engine_id for s in call.slots], close=call.release)


def eval_answer(result: Any, kind: str) -> Answer:
    """The body vLLM's own route sends: Responses dumped by alias; Anthropic's without nulls, its errors in
    Anthropic's error shape."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    if isinstance(result, ErrorResponse):
        if kind == "messages":
            return Answer(result.error.code, {"type": "error", "error": {"type": result.error.type,
                                                                         "message": result.error.message}})
        return Answer(result.error.code, result.model_dump(mode="json", by_alias=True))
    if kind == "messages":
        return Answer(200, result.model_dump(exclude_none=True))
    return Answer(200, result.model_dump(mode="json", by_alias=True))


async def _events(call: Any, head: list[Any], events: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """``head``, then the rest of ``events``, each step in the call's context (a Responses stream may still submit to
    the engine, e.g. a turn after a tool call), in the SSE form vLLM's routes send."""
    try:
        for ev in head:
            yield _sse(ev)
        while True:
            with in_call(call):  # around each step only: between steps the context is the consumer's own
                try:
                    ev = await anext(events)
                except StopAsyncIteration:
                    return
            yield _sse(ev)
    finally:
        call.release()


def _sse(ev: Any) -> bytes:
    if isinstance(ev, str):  # Anthropic's events come as SSE text
        return ev.encode()
    # Responses events, as vLLM's route frames them
    data = ev.model_dump_json(indent=None, by_alias=True)
    return f"event: {getattr(ev, 'type', 'unknown')}\ndata: {data}\n\n".encode()


def request_schemas() -> dict[str, Any]:
    """JSON schemas of vLLM's request models for the routes of routers/openai.py (tito's /openapi.json)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

    models: dict[str, Any] = {"CompletionRequest": CompletionRequest, "ChatCompletionRequest": ChatCompletionRequest,
                              "TokenizeRequest": TokenizeRequest, "DetokenizeRequest": DetokenizeRequest}
    return {name: TypeAdapter(tp).json_schema(ref_template="#/components/schemas/{model}")
            for name, tp in models.items()}
