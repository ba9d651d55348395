"""Streamed ``/v1/chat/completions`` without a pydantic model per chunk: vLLM's chat handler with its stream generator
replaced, for the streams it can write exactly, by one that writes the same events with orjson.

vLLM builds a ``ChatCompletionStreamResponse``, its choice and a ``DeltaMessage`` (whose serializer is a Python
function) for every engine output and dumps them (``model_dump_json(exclude_unset=True)``). The generator here is
vLLM 0.32's ``chat_completion_stream_generator`` step for step (the role chunk first, content deltas, logprobs in chat
form, ``n``, continuous usage and include_usage, finish reasons, the fingerprint, errors), each chunk a dict holding
the fields vLLM's models set, in their order: the same bytes (tests/test_openai_chat_stream.py holds the two to each
other). What happens once per request (the usage chunk, echo, error events) still goes through vLLM's models.

vLLM's own generator serves whatever depends on a parser: a tool or reasoning parser (``--tool-call-parser``,
``--reasoning-parser``; harmony models get a parser only with one of those) turns the text into tool calls and
reasoning deltas, counts reasoning tokens and hides metadata. So does output logging (``--enable-log-outputs``).

Like the completion generator (``openai_stream``), it yields ready SSE bytes, the chunks that carry a finish reason as
dicts (the layer adds tito's ``weight_versions`` to those), and vLLM's error events as strings.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, Final

import orjson

from app.engine.openai_stream import Event, request_metrics, sse

if TYPE_CHECKING:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

_OBJECT: Final = "chat.completion.chunk"


def chat_class() -> type:
    """vLLM's ``OpenAIServingChat`` with the lean stream generator (a class made at first use: vLLM is imported only
    by the engine's layer)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.entrypoints.serve.utils.api_utils import should_include_usage
    from vllm.exceptions import GenerationError
    from vllm.utils.collection_utils import as_list

    class LeanChat(OpenAIServingChat):  # type: ignore[misc]
        def lean_stream(self) -> bool:
            """Whether this server's streams are the lean generator's (else vLLM's): no parser, no output logging."""
            return (self.parser_cls is None and not self._include_reasoning_tokens_details
                    and not (self.enable_log_outputs and self.request_logger))

        def chat_completion_stream_generator(  # type: ignore[override]
            self, request: ChatCompletionRequest, result_generator: AsyncIterator[Any], request_id: str,
            model_name: str, conversation: list[Any], tokenizer: Any, request_metadata: Any,
            chat_template_kwargs: dict[str, Any] | None = None, mm_token_counts: dict[str, int] | None = None,
        ) -> AsyncGenerator[Event | str, None]:
            if not self.lean_stream():
                return super().chat_completion_stream_generator(  # type: ignore[no-any-return]
                    request, result_generator, request_id, model_name, conversation, tokenizer, request_metadata,
                    chat_template_kwargs=chat_template_kwargs, mm_token_counts=mm_token_counts)
            return self._lean_stream(request, result_generator, request_id, model_name, conversation, tokenizer,
                                     request_metadata, mm_token_counts)

        async def _lean_stream(
            self, request: ChatCompletionRequest, result_generator: AsyncIterator[Any], request_id: str,
            model_name: str, conversation: list[Any], tokenizer: Any, request_metadata: Any,
            mm_token_counts: dict[str, int] | None,
        ) -> AsyncGenerator[Event | str, None]:
            created_time = int(time.time())
            num_choices = 1 if request.n is None else request.n
            previous_num_tokens = [0] * num_choices
            finish_reason_sent = [False] * num_choices
            num_prompt_tokens = 0
            num_cached_tokens = num_cache_creation_tokens = None
            include_usage, include_continuous_usage = should_include_usage(
                request.stream_options, self.enable_force_include_usage)
            fingerprint = None if include_usage else self.system_fingerprint
            want_lp, return_ids = request.logprobs, request.return_token_ids
            # What every chunk begins with (the fields vLLM's chunk model sets, in its order), made JSON once.
            head = {"id": request_id, "object": _OBJECT, "created": created_time, "model": model_name}
            prefix = b"data: " + orjson.dumps(head)[:-1] + b',"choices":['
            first_iteration = True
            last_res = None
            try:
                async for res in result_generator:
                    last_res = res
                    if res.prompt_token_ids is not None:
                        num_prompt_tokens = len(res.prompt_token_ids)
                        if res.encoder_prompt_token_ids is not None:
                            num_prompt_tokens += len(res.encoder_prompt_token_ids)
                    if first_iteration:
                        num_cached_tokens = res.num_cached_tokens
                        num_cache_creation_tokens = res.num_cache_creation_tokens
                        role = self.get_chat_request_role(request)
                        for i in range(num_choices):
                            chunk: dict[str, Any] = {**head, "choices": [
                                {"index": i, "delta": {"role": role, "content": ""}, "logprobs": None,
                                 "finish_reason": None}]}
                            if include_continuous_usage:
                                chunk["usage"] = _usage(num_prompt_tokens, 0)
                            ids = res.prompt_token_ids if return_ids else None
                            chunk["prompt_token_ids"] = None if ids is None else as_list(ids)
                            chunk["prompt_text"] = res.prompt if request.return_prompt_text else None
                            yield sse(chunk)
                        if request.echo:
                            for data in self._echo(request, conversation, role, num_choices, request_id,
                                                   created_time, model_name, num_prompt_tokens,
                                                   include_continuous_usage):
                                yield data
                        first_iteration = False

                    for output in res.outputs:
                        i = output.index
                        if finish_reason_sent[i]:
                            continue
                        finish_reason = output.finish_reason
                        self._raise_if_error(finish_reason, request_id)
                        logprobs = None
                        if want_lp:
                            assert output.logprobs is not None, "Did not output logprobs"
                            logprobs = self._lean_logprobs(output.token_ids, output.logprobs, tokenizer, request)
                        delta_text = output.text
                        if not delta_text and not output.token_ids and not previous_num_tokens[i]:
                            continue  # chunked prefill: vLLM sends no empty chunk
                        previous_num_tokens[i] += len(output.token_ids)
                        token_ids = as_list(output.token_ids) if return_ids else None
                        if finish_reason is None:
                            choice = {"index": i, "delta": {"content": delta_text}, "logprobs": logprobs,
                                      "finish_reason": None, "token_ids": token_ids}
                            if include_continuous_usage:
                                yield (prefix + orjson.dumps(choice) + b'],"usage":'
                                       + orjson.dumps(_usage(num_prompt_tokens, previous_num_tokens[i]))
                                       + b"}\n\n")
                            else:
                                yield prefix + orjson.dumps(choice) + b"]}\n\n"
                            continue
                        finish_reason_sent[i] = True
                        chunk = {**head, "choices": [
                            {"index": i, "delta": {"content": delta_text}, "logprobs": logprobs,
                             "finish_reason": finish_reason or "stop", "stop_reason": output.stop_reason,
                             "token_ids": token_ids}]}
                        if include_continuous_usage:
                            chunk["usage"] = _usage(num_prompt_tokens, previous_num_tokens[i])
                        if fingerprint is not None:
                            chunk["system_fingerprint"] = fingerprint
                        yield chunk

                completion_tokens = sum(previous_num_tokens)
                if include_usage:
                    yield self._final_usage(request, last_res, num_prompt_tokens, completion_tokens,
                                            num_cached_tokens, num_cache_creation_tokens, mm_token_counts,
                                            request_id, created_time, model_name)
                request_metadata.final_usage_info = UsageInfo(
                    prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=num_prompt_tokens + completion_tokens, completion_tokens_details=None)
            except GenerationError as e:
                yield f"data: {self._convert_generation_error_to_streaming_response(e)}\n\n"
            except Exception as e:  # noqa: BLE001 - as vLLM's generator: an error event, then [DONE]
                from vllm.entrypoints.openai.chat_completion.serving import logger

                logger.exception("Error in chat completion stream generator.")
                yield f"data: {self.create_streaming_error_response(e)}\n\n"
            yield b"data: [DONE]\n\n"

        def _lean_logprobs(self, token_ids: Any, top: Any, tokenizer: Any,
                           request: ChatCompletionRequest) -> dict[str, Any]:
            """vLLM's ``_create_chat_logprobs`` as the dict its model dumps to (``exclude_unset``: a token without
            its own logprob has neither ``logprob`` nor ``top_logprobs``)."""
            as_id = request.return_tokens_as_token_ids
            if as_id is None:
                as_id = self.return_tokens_as_token_ids
            num_top = request.top_logprobs
            take_all = bool(request.logprob_token_ids) or num_top == -1
            content: list[dict[str, Any]] = []
            for i, token_id in enumerate(token_ids):
                step = top[i]
                lp = None if step is None else step.get(token_id)
                if lp is None:
                    token = f"token_id:{token_id}" if as_id else self._decode_one(tokenizer, token_id)
                    content.append({"token": token, "bytes": list(token.encode("utf-8", errors="replace"))})
                    continue
                tops = []
                for j, (tid, p) in enumerate(step.items()):
                    if not (take_all or (num_top is not None and j < num_top)):
                        break  # vLLM's filter keeps a prefix of the dict
                    tok = self._decoded(p, tid, tokenizer, as_id)
                    tops.append({"token": tok, "logprob": float(max(p.logprob, -9999.0)),
                                 "bytes": list(tok.encode("utf-8", errors="replace"))})
                decoded = lp.decoded_token
                content.append({
                    "token": self._decoded(lp, token_id, tokenizer, as_id),
                    "logprob": float(max(lp.logprob, -9999.0)),
                    "bytes": None if decoded is None else list(decoded.encode("utf-8", errors="replace")),
                    "top_logprobs": tops})
            return {"content": content}

        def _decoded(self, lp: Any, token_id: int, tokenizer: Any, as_id: bool) -> str:
            if as_id:
                return f"token_id:{token_id}"
            if lp.decoded_token is not None:
                return str(lp.decoded_token)
            return str(self._get_decoded_token(lp, token_id, tokenizer, return_as_token_id=False))

        @staticmethod
        def _decode_one(tokenizer: Any, token_id: int) -> str:
            if tokenizer is None:
                raise ValueError("Unable to get tokenizer because `skip_tokenizer_init=True`")
            return str(tokenizer.decode(token_id))

        def _echo(self, request: ChatCompletionRequest, conversation: list[Any], role: str, num_choices: int,
                  request_id: str, created_time: int, model_name: str, num_prompt_tokens: int,
                  continuous: bool) -> list[bytes]:
            """vLLM's echo of the last message's content, through its models as vLLM makes them (once per
            request)."""
            from vllm.entrypoints.generate.base.protocol import DeltaMessage
            from vllm.entrypoints.openai.chat_completion.protocol import (
                ChatCompletionResponseStreamChoice,
                ChatCompletionStreamResponse,
            )

            content: Any = ""
            if conversation and "content" in conversation[-1] and conversation[-1].get("role") == role:
                content = conversation[-1]["content"] or ""
            out = []
            for i in range(num_choices if content else 0):
                choice = ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(content=content),
                                                            logprobs=None, finish_reason=None)
                chunk = ChatCompletionStreamResponse(id=request_id, object=_OBJECT, created=created_time,
                                                     choices=[choice], model=model_name)
                if continuous:
                    chunk.usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=0,
                                            total_tokens=num_prompt_tokens, completion_tokens_details=None)
                out.append(f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n".encode())
            return out

        def _final_usage(self, request: ChatCompletionRequest, last_res: Any, num_prompt_tokens: int,
                         completion_tokens: int, num_cached_tokens: int | None,
                         num_cache_creation_tokens: int | None, mm_token_counts: dict[str, int] | None,
                         request_id: str, created_time: int, model_name: str) -> bytes:
            """vLLM's usage chunk, through its model as vLLM makes it (once per request)."""
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse
            from vllm.entrypoints.openai.chat_completion.serving import _make_prompt_tokens_details

            usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                              total_tokens=num_prompt_tokens + completion_tokens, completion_tokens_details=None)
            usage.prompt_tokens_details = _make_prompt_tokens_details(
                self.enable_prompt_tokens_details, num_cached_tokens, num_cache_creation_tokens, mm_token_counts)
            metrics = None
            if (request.n or 1) == 1:  # vLLM: no per-request metrics for n > 1
                metrics = request_metrics(self.enable_per_request_metrics, last_res, completion_tokens)
            chunk = ChatCompletionStreamResponse(id=request_id, object=_OBJECT, created=created_time, choices=[],
                                                 model=model_name, usage=usage,
                                                 system_fingerprint=self.system_fingerprint, metrics=metrics)
            return f"data: {chunk.model_dump_json(exclude_unset=True, exclude_none=True)}\n\n".encode()

    return LeanChat


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A continuous-usage ``UsageInfo`` as vLLM's chunk dumps it: every field it sets, in the model's order (no
    reasoning parser: the details are null)."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "completion_tokens_details": None}
