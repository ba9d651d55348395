"""vLLM's own OpenAI serving layer (completions, chat, tokenize, render) behind tito's admission and validation.

Part of the engine adapter: routers/openai.py speaks HTTP and calls ``OpenAILayer``; only this module touches vLLM's
serving classes. They are vLLM's, unchanged, built as vLLM's own server builds them, with two things of tito's given
to them instead of vLLM's:

- the engine client is ``_GatedClient``: the ``AsyncLLM``, except that ``generate()`` first checks the engine-bound
  prompt and ``SamplingParams`` with tito's limits (a 4xx before anything reaches the engine, also for a stream,
  whose 200 has not been sent yet when vLLM calls ``generate()``), then counts the request in flight under a unique
  engine id (``AppState.enter``: drain waits for it, ``/abort_requests`` finds it) and records the weight-version
  spans of its outputs;
- the model registry is ``_Models``: its LoRA adapters are tito's (``LoraManager``), so ``model`` picks an adapter
  exactly as on the token API.

What an OpenAI call needs from the server travels in a ``Gate``; the call's state lives in a ``ContextVar`` that
vLLM's handler, running in the caller's task, carries into ``generate()``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import TypeAdapter, ValidationError

from app.core.multimodal import MediaPolicy, check_url
from app.core.protocol import ApiError, bad_request, validation_error
from app.engine.errors import vllm_error_response
from app.engine.openai_chat_stream import chat_class
from app.engine.openai_stream import completion_class
from app.engine.sampling import Limits, check_engine_params, check_ids

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger("tito.openai")

NO_TOKENIZER = ("this server has no tokenizer (the model directory ships none, or it runs with --skip-tokenizer-init)"
                ": it serves token ids only")
_MEDIA_KEYS = {"image_url": "image", "audio_url": "audio", "video_url": "video", "input_audio": "audio",
               "image_embeds": "image", "image_pil": "image"}


def handler_kwargs(llm: AsyncLLM, o: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments vLLM's server gives its OpenAI handlers, from its front-end arguments ``o``."""
    from vllm.entrypoints.launchers.cli_args import resolve_default_chat_template_kwargs
    from vllm.entrypoints.serve.utils.request_logger import RequestLogger
    from vllm.renderers.chat_utils import load_chat_template

    enable_log_requests = bool(getattr(llm, "log_requests", False))
    return dict(
        request_logger=RequestLogger(max_log_len=o.max_log_len) if enable_log_requests else None,
        chat_template=load_chat_template(o.chat_template),
        chat_template_content_format=o.chat_template_content_format,
        default_chat_template_kwargs=resolve_default_chat_template_kwargs(o),
        trust_request_chat_template=o.trust_request_chat_template,
        return_tokens_as_token_ids=o.return_tokens_as_token_ids,
        enable_auto_tools=o.enable_auto_tool_choice,
        exclude_tools_when_tool_choice_none=o.exclude_tools_when_tool_choice_none,
        tool_parser=o.tool_call_parser,
        tool_strict_level=o.tool_strict_level,
        reasoning_parser=llm.vllm_config.structured_outputs_config.reasoning_parser,
        enable_prompt_tokens_details=o.enable_prompt_tokens_details,
        enable_force_include_usage=o.enable_force_include_usage,
        enable_log_outputs=o.enable_log_outputs,
        enable_log_deltas=o.enable_log_deltas,
        enable_per_request_metrics=o.enable_per_request_metrics,
    )


def pick(d: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: d[k] for k in keys}


@dataclass
class Gate:
    """What the server lends one OpenAI call (built by routers/openai.py from AppState)."""

    limits: Limits
    enter: Callable[[str, str], str]  # (client id, engine id base) -> the request's unique engine id
    leave: Callable[[str], None]
    name: Callable[[str], None]  # told the id the client sees, once known (log lines carry it)


@dataclass
class Answer:
    """What a call produced: a JSON body (an answer or an error envelope) or an SSE stream of encoded events."""

    status: int
    body: dict[str, Any] | None = None
    stream: AsyncIterator[bytes] | None = None
    request_id: str | None = None
    engine_ids: list[str] = field(default_factory=list)
    close: Callable[[], None] = lambda: None  # releases in-flight slots never started (idempotent)


@dataclass
class _Slot:
    engine_id: str
    released: bool = False
    order: list[int] = field(default_factory=list)  # output indexes in the order of the last RequestOutput
    spans: dict[int, Any] = field(default_factory=dict)  # output index -> its last weight-version spans (vLLM's)


@dataclass
class _Call:
    gate: Gate
    client_id: str
    tokenizer: bool
    slots: list[_Slot] = field(default_factory=list)

    def leave(self, slot: _Slot) -> None:
        if not slot.released:
            slot.released = True
            self.gate.leave(slot.engine_id)

    def release(self) -> None:
        for slot in self.slots:
            self.leave(slot)

    def record(self, slot: _Slot, res: RequestOutput) -> None:
        slot.order = [o.index for o in res.outputs]
        for o in res.outputs:
            if o.weight_versions is not None:
                slot.spans[o.index] = o.weight_versions  # made JSON once, when read: a stream writes every token

    def spans(self, prompt: int, index: int) -> list[dict[str, Any]] | None:
        spans = self.slots[prompt].spans.get(index) if prompt < len(self.slots) else None
        return None if spans is None else [{"version": s.version, "start": s.start, "end": s.end} for s in spans]


_CALL: ContextVar[_Call | None] = ContextVar("tito_openai_call", default=None)


@contextlib.contextmanager
def in_call(call: _Call) -> Iterator[None]:
    """``call`` as the context the ``generate()`` calls of vLLM's handler are gated by, while the block runs."""
    token = _CALL.set(call)
    try:
        yield
    finally:
        _CALL.reset(token)


class _GatedClient:
    """vLLM's engine client (``AsyncLLM``) as vLLM's serving classes see it, with ``generate()`` gated by tito."""

    def __init__(self, llm: AsyncLLM, salt: Callable[[], str | None]) -> None:
        self._llm = llm
        self._salt = salt  # the engine's salt for requests that bring none (Engine.kept_cache_across_update)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str, *, priority: int = 0,
                 **kw: Any) -> AsyncIterator[RequestOutput]:
        call = _CALL.get()
        if call is None:  # only OpenAILayer's calls reach here; anything else is a bug, not a request
            raise RuntimeError("OpenAI serving generate() outside a gated call")
        if not isinstance(prompt, dict) or prompt.get("type") not in ("token", None) \
                or "prompt_token_ids" not in prompt:
            raise bad_request("this server takes token or text prompts only (no embeddings or media here).",
                              "prompt")
        ids = list(prompt["prompt_token_ids"])
        if not prompt.get("cache_salt") and (salt := self._salt()):
            prompt = {**prompt, "cache_salt": salt}
        check_engine_params(sampling_params, ids, call.gate.limits, priority=priority, tokenizer=call.tokenizer)
        # And vLLM's own checks of the params (SamplingParams.verify, feature gates such as thinking_token_budget),
        # which the engine client would otherwise make after the answer began; they do not modify the params. The
        # tasks are the ones AsyncLLM cached at its first request (the warm-up's).
        tasks: Any = getattr(self._llm, "_supported_tasks", None) or ("generate",)
        self._llm.input_processor._validate_params(sampling_params, tasks)
        engine_id = call.gate.enter(call.client_id, request_id)
        slot = _Slot(engine_id)
        call.slots.append(slot)
        gen = self._llm.generate(prompt, sampling_params, engine_id, priority=priority, **kw)  # type: ignore[arg-type]
        return self._tracked(gen, slot, call)

    @staticmethod
    async def _tracked(gen: AsyncIterator[RequestOutput], slot: _Slot, call: _Call) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            async for out in gen:
                call.record(slot, out)
                yield out
            finished = True
        finally:
            call.leave(slot)
            if not finished:
                # Closed at a yield (the client left): AsyncLLM aborts the engine request when its generator closes.
                with contextlib.suppress(Exception):
                    await gen.aclose()  # type: ignore[attr-defined]


def _models_class() -> type:
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels

    class _Models(OpenAIServingModels):  # type: ignore[misc]
        """vLLM's model registry with tito's LoRA adapters (app/adapters.py), read at every request."""

        loras: Callable[[], dict[str, Any]] = dict

        @property  # type: ignore[override]
        def lora_requests(self) -> dict[str, LoRARequest]:
            return self.loras()

        @lora_requests.setter
        def lora_requests(self, _: Any) -> None:
            pass  # vLLM's __init__ sets an empty dict; tito's registry is the only one

    return _Models


class OpenAILayer:
    """vLLM's completion, chat, tokenization and render handlers over one engine (``Engine.openai_layer``)."""

    def __init__(self, llm: AsyncLLM, names: list[str], model_path: str, loras: Callable[[], dict[str, Any]],
                 media: MediaPolicy, multimodal: bool, options: argparse.Namespace,
                 salt: Callable[[], str | None] = lambda: None) -> None:
        """``options``: vLLM's front-end arguments (``vllm_args.frontend_options``: chat template, tool and reasoning
        parsers, ...), applied to each handler as vLLM's own server applies them."""
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.scale_out.render.serving import ServingRender
        from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
        from vllm.entrypoints.serve.utils.fingerprint import set_default_fingerprint_mode
        from vllm.renderers.online_renderer import OnlineRenderer

        client: Any = _GatedClient(llm, salt)
        self.tokenizer = not llm.model_config.skip_tokenizer_init
        self.media, self.multimodal = media, multimodal
        self.models = _models_class()(engine_client=client,
                                      base_model_paths=[BaseModelPath(name=n, model_path=model_path) for n in names])
        self.models.loras = loras
        self.options = o = options
        set_default_fingerprint_mode(o.fingerprint_mode, o.fingerprint_value)
        # What vLLM's server passes to each of its handlers, from the same arguments (app_state.py, api_router.py).
        self.common = common = handler_kwargs(llm, o)
        self.renderer = renderer = OnlineRenderer(
            model_config=llm.model_config, renderer=llm.renderer, request_logger=common["request_logger"],
            trust_request_mm_kwargs=o.trust_request_mm_kwargs, log_error_stack=o.log_error_stack,
            **pick(common, "chat_template", "chat_template_content_format", "trust_request_chat_template",
                   "exclude_tools_when_tool_choice_none", "tool_parser", "tool_strict_level", "reasoning_parser",
                   "default_chat_template_kwargs"), enable_auto_tools=common["enable_auto_tools"])
        if self.tokenizer:
            renderer.warmup()
        # tito counts cached prompt tokens on these two routes unless told not to (vLLM: only when told to).
        details = o.enable_prompt_tokens_details if "enable_prompt_tokens_details" in o.given else True
        self.completion = completion_class()(  # vLLM's handler, its stream written without a model per chunk
            client, self.models, online_renderer=renderer, enable_prompt_tokens_details=details,
            **pick(common, "request_logger", "return_tokens_as_token_ids", "enable_force_include_usage",
                   "enable_per_request_metrics"))
        self.chat = chat_class()(  # the same, its plain streams written without a model per chunk
            client, self.models, o.response_role, online_renderer=renderer, enable_prompt_tokens_details=details,
            **pick(common, "request_logger", "chat_template", "chat_template_content_format",
                   "default_chat_template_kwargs", "trust_request_chat_template", "return_tokens_as_token_ids",
                   "enable_auto_tools", "exclude_tools_when_tool_choice_none", "tool_parser", "tool_strict_level",
                   "reasoning_parser", "enable_force_include_usage", "enable_log_outputs", "enable_log_deltas",
                   "enable_per_request_metrics")) if self.tokenizer else None
        self.tokenization = ServingTokenization(
            self.models, renderer, **pick(common, "request_logger", "chat_template", "chat_template_content_format",
                                          "default_chat_template_kwargs", "trust_request_chat_template"))
        self.render = ServingRender(self.models, renderer)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

        self._types: dict[str, TypeAdapter[Any]] = {
            "completion": TypeAdapter(CompletionRequest), "chat": TypeAdapter(ChatCompletionRequest),
            "tokenize": TypeAdapter(TokenizeRequest), "detokenize": TypeAdapter(DetokenizeRequest)}

    # ------------------------------------------------------------------ requests

    def _parse(self, kind: str, body: bytes) -> Any:
        try:
            return self._types[kind].validate_json(body)
        except ValidationError as e:
            if any(err["type"] == "json_invalid" for err in e.errors()):
                raise ApiError(400, "request body is not valid JSON.", type="Bad Request", param="body") from None
            raise validation_error(e) from None
        except Exception as e:  # noqa: BLE001 - vLLM's model validators raise its own errors, which pydantic passes on
            answer = vllm_error_response(e)  # else: a validator tripping over a malformed body (test_fuzz.py), a 400
            if answer is None:
                raise bad_request(f"invalid body: {e!r}", "body") from None
            err = answer.error
            raise ApiError(err.code, err.message, type=err.type, param=err.param) from None

    def _need_tokenizer(self, what: str, param: str | None = None) -> None:
        if not self.tokenizer:
            raise bad_request(f"{what} needs a tokenizer; {NO_TOKENIZER}.", param)

    async def completions(self, raw: Any, body: bytes, gate: Gate) -> Answer:
        req = self._parse("completion", body)
        prompt = req.prompt
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
            self._need_tokenizer("a text prompt", "prompt")
        if req.prompt_embeds is not None:
            raise bad_request("prompt_embeds are not served here; send token ids.", "prompt_embeds")
        if req.suffix is not None:
            raise bad_request("suffix is not supported.", "suffix")
        if not self.tokenizer:
            if req.echo and not req.return_token_ids:
                self._need_tokenizer("echo without return_token_ids", "echo")
            if req.logprobs is not None and not req.return_tokens_as_token_ids:
                raise bad_request(f"logprobs name tokens by their text unless return_tokens_as_token_ids is true; "
                                  f"{NO_TOKENIZER}.", "return_tokens_as_token_ids")
        self._no_beam_search(req)
        call = self._call(gate, "cmpl-", raw, req.request_id)
        return await self._run(call, self.completion.create_completion(req, raw), req.n or 1, chat=False)

    async def chat_completions(self, raw: Any, body: bytes, gate: Gate) -> Answer:
        self._need_tokenizer("chat (the chat template)")
        req = self._parse("chat", body)
        self._no_beam_search(req)
        self._check_media(req.messages)
        call = self._call(gate, "chatcmpl-", raw, req.request_id)
        assert self.chat is not None
        return await self._run(call, self.chat.create_chat_completion(req, raw), req.n or 1, chat=True)

    async def render_chat(self, raw: Any, body: bytes) -> Answer:
        self._need_tokenizer("rendering a chat (the chat template)")
        req = self._parse("chat", body)
        self._check_media(req.messages)
        return self._answer(await self._guard(self.render.render_chat_request(req, raw)))

    async def tokenize(self, raw: Any, body: bytes) -> Answer:
        self._need_tokenizer("/tokenize")
        req = self._parse("tokenize", body)
        self._check_media(getattr(req, "messages", None))
        return self._answer(await self._guard(self.tokenization.create_tokenize(req, raw)))

    async def detokenize(self, raw: Any, body: bytes, limits: Limits) -> Answer:
        self._need_tokenizer("/detokenize")
        req = self._parse("detokenize", body)
        check_ids(req.tokens, limits.vocab_size, "tokens")
        return self._answer(await self._guard(self.tokenization.create_detokenize(req, raw)))

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _no_beam_search(req: Any) -> None:
        if getattr(req, "use_beam_search", False):
            raise bad_request("beam search is not served here.", "use_beam_search")

    def _check_media(self, messages: Any) -> None:
        """Media in chat messages: refused by a text-only model, else held to the server's media policy (the same
        URL rules and item cap as ``content_parts``) before vLLM loads anything."""
        n = 0
        for i, m in enumerate(messages or ()):
            content = m.get("content") if isinstance(m, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else ()):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in _MEDIA_KEYS:
                    continue
                param = f"messages.{i}.content.{j}"
                if not self.multimodal:
                    raise bad_request("this model takes no multimodal input.", param)
                n += 1
                if n > self.media.max_items:
                    raise bad_request(f"at most {self.media.max_items} media items per request.", param)
                url = part.get(kind)
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise bad_request("media items must be URLs (data:, or as --allowed-media-domains allows).",
                                      param)
                check_url(url, _MEDIA_KEYS[kind], self.media, param)

    def _call(self, gate: Gate, prefix: str, raw: Any, body_id: str) -> _Call:
        # vLLM's own id: X-Request-Id, else the body's request_id (a fresh uuid when absent).
        client_id = prefix + (raw.headers.get("x-request-id") or body_id)
        gate.name(client_id)
        return _Call(gate, client_id, self.tokenizer)

    async def _guard(self, aw: Any) -> Any:
        """Await a vLLM handler, turning what vLLM's exception handlers would answer into the same answer."""
        try:
            return await aw
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - vLLM's answer, or re-raised (a dead engine: 503; else 500)
            answer = vllm_error_response(e)
            if answer is None:
                raise
            return answer

    def _answer(self, result: Any) -> Answer:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if isinstance(result, ErrorResponse):
            return Answer(result.error.code, result.model_dump())
        return Answer(200, result.model_dump())

    async def gated(self, call: _Call, aw: Any) -> Any:
        """Await vLLM's handler with ``call`` as the context its ``generate()`` calls are gated by."""
        with in_call(call):
            try:
                return await self._guard(aw)
            except BaseException:
                call.release()
                raise

    async def _run(self, call: _Call, aw: Any, n: int, *, chat: bool) -> Answer:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        result = await self.gated(call, aw)
        ids = [s.engine_id for s in call.slots]
        if isinstance(result, ErrorResponse):
            call.release()
            return Answer(result.error.code, result.model_dump(), request_id=call.client_id, engine_ids=ids)
        if hasattr(result, "model_dump"):
            call.release()
            body = result.model_dump()
            self._add_spans(call, body.get("choices") or [], n, chat, final=True)
            return Answer(200, body, request_id=call.client_id, engine_ids=ids)
        return Answer(200, stream=self._events(call, result, n, chat), request_id=call.client_id, engine_ids=ids,
                      close=call.release)

    @staticmethod
    def _add_spans(call: _Call, choices: list[dict[str, Any]], n: int, chat: bool, *, final: bool) -> bool:
        """tito's ``weight_versions`` on every finished choice (the token API's spans over the output tokens);
        whether any choice got them."""
        if final and not chat:
            # vLLM numbers completion choices in the order of each prompt's outputs, prompt after prompt.
            order = [(p, i) for p, s in enumerate(call.slots) for i in (s.order or range(n))]
            for c, (p, i) in zip(choices, order, strict=False):
                c["weight_versions"] = call.spans(p, i)
            return True
        added = False
        for c in choices:
            if c.get("finish_reason") is not None:
                idx = int(c.get("index", 0))
                c["weight_versions"] = call.spans(0, idx) if chat else call.spans(idx // n, idx % n)
                added = True
        return added

    async def _events(self, call: _Call, events: AsyncIterator[Any], n: int, chat: bool) -> AsyncIterator[bytes]:
        """The stream's events as bytes, tito's spans added to the chunks that finish a choice. vLLM's generators
        yield strings; tito's (``openai_stream``, ``openai_chat_stream``) bytes, and the finishing chunks as dicts.
        Once a stream of one choice has finished, what follows (usage, ``[DONE]``) is made without waiting on the
        engine, so it is held back and goes out with the finishing chunk in one write."""
        held: list[bytes] | None = None
        single = n == 1 and len(call.slots) == 1
        try:
            async for ev in events:
                if type(ev) is bytes:
                    data = ev
                elif type(ev) is dict:
                    self._add_spans(call, ev.get("choices") or [], n, chat, final=False)
                    data = b"data: " + orjson.dumps(ev) + b"\n\n"
                    if single and held is None:
                        held = []
                elif ev.startswith("data: {") and '"finish_reason":null' not in ev and '"finish_reason"' in ev:
                    parsed = orjson.loads(ev[6:])
                    data = (b"data: " + orjson.dumps(parsed) + b"\n\n"
                            if self._add_spans(call, parsed.get("choices") or [], n, chat, final=False)
                            else ev.encode())
                else:
                    data = ev.encode()
                if held is None:
                    yield data
                else:
                    held.append(data)
            if held:
                yield b"".join(held)
        finally:
            call.release()
