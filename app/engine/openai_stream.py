"""Streamed ``/v1/completions`` without a pydantic model per chunk: vLLM's completion handler with its stream
generator replaced by one that writes the same events with orjson.

vLLM builds a ``CompletionStreamResponse`` for every engine output and dumps it (``model_dump_json(exclude_unset=
True)``): a validator, a model and a serializer per token, most of the handler's CPU on a long stream. The generator
here is vLLM 0.32's ``completion_stream_generator`` step for step (echo, n, several prompts, logprobs, continuous
usage, the fingerprint, errors), with each mid-stream chunk a dict in the model's field order: the same bytes
(tests/test_openai_stream.py holds the two to each other on the real engine). Only what happens once per request
still goes through vLLM's models (logprobs, the final usage chunk and its metrics, error events).

It yields ready SSE bytes, except the chunks that carry a finish reason, which it yields as dicts: the layer
(``openai_layer``) adds tito's ``weight_versions`` to those before dumping them.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

Event = bytes | dict[str, Any]


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def request_metrics(timing: bool, last_res: Any, completion_tokens: int) -> Any:
    """The metrics vLLM's generators put on the usage chunk of a one-sequence request: timings when the server
    asks for them (``timing``), speculative decoding's acceptance when there is any."""
    from vllm.entrypoints.generate.base.protocol import PerRequestMetrics
    from vllm.entrypoints.generate.base.serving import build_per_request_timing_metrics, build_spec_decoding_metrics

    metrics = None
    if timing:
        metrics = build_per_request_timing_metrics(last_res.metrics if last_res is not None else None,
                                                   completion_tokens)
    spec_stats = build_spec_decoding_metrics(last_res)
    if spec_stats is not None:
        if metrics is None:
            metrics = PerRequestMetrics()
        metrics.speculative_decoding = spec_stats
    return metrics


def completion_class() -> type:
    """vLLM's ``OpenAIServingCompletion`` with the lean stream generator (a class made at first use: vLLM is imported
    only by the engine's layer)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo
    from vllm.entrypoints.serve.utils.api_utils import should_include_usage
    from vllm.exceptions import GenerationError
    from vllm.utils.collection_utils import as_list

    class LeanCompletion(OpenAIServingCompletion):  # type: ignore[misc]
        async def completion_stream_generator(  # type: ignore[override]
            self, request: CompletionRequest, engine_inputs: list[Any], result_generator: AsyncIterator[Any],
            request_id: str, created_time: int, model_name: str, num_prompts: int, tokenizer: Any,
            request_metadata: Any,
        ) -> AsyncGenerator[Event | str, None]:
            num_choices = 1 if request.n is None else request.n
            next_text_offsets = [0] * num_choices * num_prompts
            previous_num_tokens = [0] * num_choices * num_prompts
            has_echoed = [False] * num_choices * num_prompts
            num_prompt_tokens = [0] * num_prompts
            num_cached_tokens = None
            first_iteration = True
            include_usage, include_continuous_usage = should_include_usage(
                request.stream_options, self.enable_force_include_usage)
            fingerprint = None if include_usage else self.system_fingerprint
            echo, return_ids, num_lp = request.echo, request.return_token_ids, request.logprobs
            # The fields vLLM's chunk model sets, in its order (exclude_unset drops the rest).
            head = {"id": request_id, "object": "text_completion", "created": created_time, "model": model_name}
            last_res = None
            try:
                async for prompt_idx, res in result_generator:
                    last_res = res
                    prompt_token_ids = res.prompt_token_ids
                    prompt_logprobs = res.prompt_logprobs
                    if first_iteration:
                        num_cached_tokens = res.num_cached_tokens
                        first_iteration = False
                    prompt_text = res.prompt
                    if prompt_text is None and echo:
                        prompt_text = self._extract_prompt_text(engine_inputs[prompt_idx])
                    if prompt_token_ids is not None:
                        num_prompt_tokens[prompt_idx] = len(prompt_token_ids)

                    for output in res.outputs:
                        i = output.index + prompt_idx * num_choices
                        finish_reason = output.finish_reason
                        self._raise_if_error(finish_reason, request_id)
                        prompt_token_ids_to_return = None
                        if echo and not has_echoed[i]:
                            if return_ids:
                                prompt_text = ""
                            if request.max_tokens == 0:
                                delta_text, delta_token_ids, out_logprobs = (prompt_text, prompt_token_ids,
                                                                             prompt_logprobs)
                            else:
                                delta_text = prompt_text + output.text
                                delta_token_ids = [*prompt_token_ids, *output.token_ids]
                                out_logprobs = [*(prompt_logprobs or []), *(output.logprobs or [])]
                            prompt_token_ids_to_return = prompt_token_ids
                            has_echoed[i] = True
                        else:
                            delta_text, delta_token_ids, out_logprobs = (output.text, output.token_ids,
                                                                         output.logprobs)
                            if not has_echoed[i] and return_ids:
                                prompt_token_ids_to_return = prompt_token_ids
                                has_echoed[i] = True
                            if not delta_text and not delta_token_ids and not previous_num_tokens[i]:
                                continue  # chunked prefill: vLLM sends no empty chunk

                        logprobs = None
                        if num_lp is not None:
                            assert out_logprobs is not None, "Did not output logprobs"
                            lp = self._create_completion_logprobs(
                                token_ids=delta_token_ids, top_logprobs=out_logprobs, num_output_top_logprobs=num_lp,
                                tokenizer=tokenizer, logprob_token_ids=request.logprob_token_ids,
                                initial_text_offset=next_text_offsets[i],
                                return_as_token_id=request.return_tokens_as_token_ids)
                            if lp.tokens:
                                next_text_offsets[i] = lp.text_offset[-1] + len(lp.tokens[-1])
                            logprobs = lp.model_dump()

                        previous_num_tokens[i] += len(output.token_ids)
                        chunk = {**head, "choices": [{
                            "index": i, "text": delta_text, "logprobs": logprobs, "finish_reason": finish_reason,
                            "stop_reason": output.stop_reason,
                            "prompt_token_ids": None if prompt_token_ids_to_return is None
                            else as_list(prompt_token_ids_to_return),
                            "token_ids": as_list(output.token_ids) if return_ids else None}]}
                        if include_continuous_usage:
                            prompt_tokens, completion_tokens = num_prompt_tokens[prompt_idx], previous_num_tokens[i]
                            chunk["usage"] = {"prompt_tokens": prompt_tokens,
                                              "total_tokens": prompt_tokens + completion_tokens,
                                              "completion_tokens": completion_tokens}
                        if finish_reason is None:
                            yield sse(chunk)
                            continue
                        if fingerprint is not None:
                            chunk["system_fingerprint"] = fingerprint
                        yield chunk

                total_prompt_tokens = sum(num_prompt_tokens)
                total_completion_tokens = sum(previous_num_tokens)
                final_usage_info = UsageInfo(prompt_tokens=total_prompt_tokens,
                                             completion_tokens=total_completion_tokens,
                                             total_tokens=total_prompt_tokens + total_completion_tokens)
                if self.enable_prompt_tokens_details and num_cached_tokens is not None:
                    final_usage_info.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=num_cached_tokens)
                if include_usage:
                    usage = self._final_usage(request, num_prompts, last_res, final_usage_info,
                                              total_completion_tokens, request_id, created_time, model_name)
                    yield f"data: {usage}\n\n".encode()
                request_metadata.final_usage_info = final_usage_info
            except GenerationError as e:
                yield f"data: {self._convert_generation_error_to_streaming_response(e)}\n\n"
            except Exception as e:  # noqa: BLE001 - as vLLM's generator: an error event, then [DONE]
                from vllm.entrypoints.openai.completion.serving import logger

                logger.exception("Error in completion stream generator.")
                yield f"data: {self.create_streaming_error_response(e)}\n\n"
            yield b"data: [DONE]\n\n"

        def _final_usage(self, request: CompletionRequest, num_prompts: int, last_res: Any, usage: Any,
                         total_completion_tokens: int, request_id: str, created_time: int, model_name: str) -> str:
            """vLLM's usage chunk, through its model as vLLM makes it (once per request)."""
            metrics = None
            if num_prompts == 1 and (request.n or 1) == 1:
                metrics = request_metrics(self.enable_per_request_metrics, last_res, total_completion_tokens)
            chunk = CompletionStreamResponse(id=request_id, created=created_time, model=model_name, choices=[],
                                             usage=usage, system_fingerprint=self.system_fingerprint,
                                             metrics=metrics)
            return str(chunk.model_dump_json(exclude_unset=False, exclude_none=True))

    return LeanCompletion
