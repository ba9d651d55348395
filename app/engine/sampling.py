"""Sampling parameters: the one validator every transport uses, and tito's wire params → vLLM ``SamplingParams``.

vLLM 0.32's own server lets an out-of-vocabulary id reach the worker, which raises IndexError and kills the
EngineCore. The rules here (``check_prompt``, ``check_sampling``) run before the engine sees a request, on the token
API and both gRPC services (``build_sampling_params``) and on vLLM's OpenAI routes (``check_engine_params``), and fail
with a 400 naming the field, in the same words on every route.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from app.core.protocol import ApiError, GenerateRequest, WireSamplingParams, bad_request
from app.core.settings import Settings

if TYPE_CHECKING:
    # Imported where used: importing vLLM takes seconds, and the server binds its port before it
    # (app/server/startup.py).
    from vllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class Limits:
    """What the engine can take; read once from its config at start-up."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_logprobs: int
    priority_scheduling: bool
    max_logit_bias: int = 1024
    max_stop_token_ids: int = 1024
    min_tokens_refusal: str = ""  # why min_tokens > 0 is refused on this server ("": served)


# vLLM masks every id of a request's stop set (its stop_token_ids plus the eos ids it adds from the tokenizer and
# generation_config) while min_tokens is unmet, by indexing the logits with them: an eos id past the model's
# vocabulary (a tokenizer whose special tokens are not among the model's ids) raises an IndexError in the worker and
# the EngineCore dies. The ids come from the model directory, not the request, so such a server refuses min_tokens.
def min_tokens_refusal(stop_ids_outside_vocab: tuple[int, ...], vocab_size: int) -> str:
    if not stop_ids_outside_vocab:
        return ""
    return (f"min_tokens is not served with this model: its tokenizer or generation_config declares eos id(s) "
            f"{list(stop_ids_outside_vocab)} outside the model's vocabulary ({vocab_size} ids), which vLLM 0.32 masks "
            "while min_tokens is unmet and which kills the engine. Fix the model directory's tokenizer files, or "
            "start the server with --skip-tokenizer-init.")


def configured_limits(limits: Limits, settings: Settings) -> Limits:
    """``limits`` with the request-size caps set by flags (``--max-stop-token-ids``, ``--max-logit-bias``)."""
    return replace(limits, max_stop_token_ids=settings.max_stop_token_ids, max_logit_bias=settings.max_logit_bias)


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Where the text features live (routers/openai.py): vLLM's own routes, on a server with the model's tokenizer.
_TEXT_ROUTE = "/v1/completions or /v1/chat/completions on a server with the model's tokenizer"

# Keys copied as-is into SamplingParams when the client sent them.
_PASSTHROUGH = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "logprob_token_ids", "flat_logprobs", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "extra_args", "skip_reading_prefix_cache",
    "routed_experts_prompt_start", "stream_interval",
)


@dataclass(frozen=True)
class NoText:
    """Who cannot serve the text features (stop strings, bad words, structured outputs), and why: the words of
    their refusal."""

    who: str
    why: str


# The token API never detokenizes, whatever the server loaded.
TOKEN_API = NoText("the token API", "it answers token ids only")
# vLLM's own routes on a server without a tokenizer.
NO_TOKENIZER_SERVER = NoText("this server", "it has no tokenizer: the model directory ships none, or it runs with "
                                            "--skip-tokenizer-init")


def refuse_stop_strings(no_text: NoText, param: str) -> ApiError:
    return bad_request(f"stop strings need detokenization, which {no_text.who} does not do ({no_text.why}): use "
                       f"stop_token_ids, or {_TEXT_ROUTE}.", param)


def refuse_needs_tokenizer(what: str, no_text: NoText, param: str) -> ApiError:
    return bad_request(f"{what} needs a tokenizer, which {no_text.who} does not use ({no_text.why}): use "
                       f"{_TEXT_ROUTE}.", param)


def check_ids(ids: Any, vocab: int, param: str) -> None:
    """Every id of ``ids`` inside the vocabulary (the engine dies on one outside it)."""
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        bad = next(t for t in ids if t < 0 or t >= vocab)
        raise bad_request(f"{param} contains token id {bad}, outside the vocabulary [0, {vocab}).", param)


def check_prompt(token_ids: list[int], limits: Limits, param: str = "token_ids") -> None:
    n = len(token_ids)
    if n == 0:
        raise bad_request(f"{param} must not be empty.", param)
    check_ids(token_ids, limits.vocab_size, param)
    if n >= limits.max_model_len:
        raise bad_request(
            f"Input length ({n}) exceeds model's maximum context length ({limits.max_model_len}): "
            "no room left to generate a token.", param)


def _check_logprobs(value: int | None, limits: Limits, param: str) -> None:
    if value is None:
        return
    if value < -1:
        raise bad_request(f"{param} must be -1 (all) or >= 0, got {value}.", param)
    cap = limits.max_logprobs
    if cap != -1 and (value == -1 or value > cap):
        shown = "the whole vocabulary (-1)" if value == -1 else str(value)
        raise bad_request(f"{param}={shown} exceeds the server's max_logprobs ({cap}).", param)


def check_sampling(p: Any, prompt_len: int, limits: Limits, *, prefix: str, priority: int,
                   no_text: NoText | None, to_context_end: bool = False) -> None:
    """The one set of rules every transport holds sampling parameters to, before the engine sees them: the token
    API and both gRPC services (tito's wire params, before ``SamplingParams`` is built) and vLLM's OpenAI routes
    (the ``SamplingParams`` vLLM's handler built: the attribute names are the same). ``prefix`` names the params'
    place in the request (``sampling_params.`` on the token API); ``no_text``: who cannot serve stop strings, bad
    words and structured outputs here (None: served). vLLM's own checks (``SamplingParams._verify_args``: ranges,
    finite floats) run at construction, on every route. ``to_context_end``: the token API's rule (vLLM's
    ``/inference/v1/generate`` and Prime-RL's server): a ``max_tokens`` past the context end generates up to it and
    finishes with "length", where the OpenAI routes refuse it."""
    if no_text is not None:
        if p.stop:
            raise refuse_stop_strings(no_text, prefix + "stop")
        if p.bad_words:
            raise refuse_needs_tokenizer("bad_words", no_text, prefix + "bad_words")
        if p.structured_outputs:
            raise refuse_needs_tokenizer("structured_outputs", no_text, prefix + "structured_outputs")

    n = p.n if p.n is not None else 1
    if n < 1:
        raise bad_request(f"n must be at least 1, got {n}.", prefix + "n")
    if n > limits.max_num_seqs:
        raise bad_request(f"{prefix}n must be at most the server's max_num_seqs ({limits.max_num_seqs}), got {n}.",
                          prefix + "n")
    _check_logprobs(p.logprobs, limits, prefix + "logprobs")
    _check_logprobs(p.prompt_logprobs, limits, prefix + "prompt_logprobs")

    vocab = limits.vocab_size
    for name in ("stop_token_ids", "allowed_token_ids", "logprob_token_ids"):
        ids = getattr(p, name, None)
        if ids is not None:
            check_ids(ids, vocab, prefix + name)
    if p.stop_token_ids is not None and len(p.stop_token_ids) > limits.max_stop_token_ids:
        raise bad_request(f"at most {limits.max_stop_token_ids} stop_token_ids, got {len(p.stop_token_ids)}.",
                          prefix + "stop_token_ids")
    if p.allowed_token_ids is not None and not p.allowed_token_ids:
        raise bad_request("allowed_token_ids must not be empty.", prefix + "allowed_token_ids")
    if p.logit_bias:
        if len(p.logit_bias) > limits.max_logit_bias:
            raise bad_request(f"at most {limits.max_logit_bias} logit_bias entries, got {len(p.logit_bias)}.",
                              prefix + "logit_bias")
        check_ids([int(t) for t in p.logit_bias], vocab, prefix + "logit_bias")
        if not all(math.isfinite(b) for b in p.logit_bias.values()):
            raise bad_request("logit_bias values must be finite numbers.", prefix + "logit_bias")
    if p.min_tokens is not None and p.min_tokens < 0:
        raise bad_request(f"min_tokens must be >= 0, got {p.min_tokens}.", prefix + "min_tokens")
    if p.min_tokens and limits.min_tokens_refusal:
        raise bad_request(limits.min_tokens_refusal, prefix + "min_tokens")

    if priority != 0 and not limits.priority_scheduling:
        raise bad_request("priority other than 0 needs a server started with --scheduling-policy priority.",
                          "priority")

    if p.max_tokens is not None:
        if p.max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {p.max_tokens}.", prefix + "max_tokens")
        if p.max_tokens > limits.max_model_len - prompt_len and not to_context_end:
            raise bad_request(
                f"prompt ({prompt_len} tokens) + max_tokens ({p.max_tokens}) exceeds the model's maximum "
                f"context length ({limits.max_model_len}).", prefix + "max_tokens")

    # The engine's wire (msgspec) cannot carry integers beyond 64 bits: such a seed or top_k got a 500 from inside
    # the engine client. Refuse them here, with vLLM's own bounds (a torch long).
    for k in _PASSTHROUGH:
        v = getattr(p, k, None)
        if isinstance(v, int) and not isinstance(v, bool) and not _INT64_MIN <= v <= _INT64_MAX:
            raise bad_request(f"{k} must be between -2**63 and 2**63 - 1, got {v}.", prefix + k)


def check_engine_params(params: SamplingParams, token_ids: list[int], limits: Limits, *, priority: int,
                        tokenizer: bool) -> None:
    """``check_prompt`` and ``check_sampling`` on the prompt and ``SamplingParams`` that vLLM's OpenAI handler built
    (the request's keys sit at the top level of its body), before the engine sees them: anything the engine would
    refuse (or die on) after the answer started is refused here, before it."""
    check_prompt(token_ids, limits, "prompt")
    check_sampling(params, len(token_ids), limits, prefix="", priority=priority,
                   no_text=None if tokenizer else NO_TOKENIZER_SERVER)
    if not tokenizer:
        params.detokenize = False


def build_sampling_params(req: GenerateRequest, limits: Limits) -> SamplingParams:
    """Validate ``req`` (prompt already checked) and return engine-ready ``SamplingParams``."""
    wire: WireSamplingParams = req.sampling_params
    given = wire.model_fields_set
    sp = "sampling_params."

    # A tokens-only server cannot detokenize: ``detokenize`` is forced off below, as vLLM's --tokens-only does.
    if req.output_mode != "tokens":
        raise bad_request("output_mode='text' is not served by the token API (it answers token ids only, never "
                          f"detokenizing); use output_mode='tokens', or {_TEXT_ROUTE}.", "output_mode")
    check_sampling(wire, len(req.token_ids), limits, prefix=sp, priority=req.priority, no_text=TOKEN_API,
                   to_context_end=True)

    # vLLM's dataclass default of 16 silently truncates RL rollouts; fill the context instead. Past the context end
    # the engine stops there ("length") either way: bounded by the room, a huge max_tokens cannot overflow its wire.
    room = limits.max_model_len - len(req.token_ids)
    max_tokens = room if wire.max_tokens is None else min(wire.max_tokens, room)
    kwargs: dict[str, Any] = {k: getattr(wire, k) for k in _PASSTHROUGH if k in given and getattr(wire, k) is not None}
    kwargs["max_tokens"] = max_tokens
    kwargs["detokenize"] = False
    # Built for this one request and never reused: vLLM may take it as it is (a shallow copy) instead of deep-copying
    # it in add_request, ~60-180 us of the API process per request (vLLM's own OpenAI protocols do the same).
    kwargs["skip_clone"] = True
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    kwargs["output_kind"] = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    extra = dict(wire.extra_args or {})
    if req.kv_transfer_params is not None:
        extra["kv_transfer_params"] = req.kv_transfer_params
    if req.ec_transfer_params is not None:
        extra["ec_transfer_params"] = req.ec_transfer_params
    if extra:
        kwargs["extra_args"] = extra
    if wire.repetition_detection is not None:
        try:
            from vllm.sampling_params import RepetitionDetectionParams

            kwargs["repetition_detection"] = RepetitionDetectionParams(**wire.repetition_detection)
        except (TypeError, ValueError, ImportError) as e:
            raise bad_request(f"invalid repetition_detection: {e}", sp + "repetition_detection") from None
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError, OverflowError, VLLMClientError) as e:
        raise ApiError(400, str(e), param=_param_of(e)) from None


def _param_of(e: Exception) -> str | None:
    p = getattr(e, "parameter", None)
    return f"sampling_params.{p}" if p else None
