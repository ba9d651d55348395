"""Fast test (no engine): one validator for sampling parameters (app/engine/sampling.py ``check_sampling``). The token
API and both gRPC services hold tito's wire params to it before ``SamplingParams`` is built; vLLM's OpenAI routes
hold the ``SamplingParams`` vLLM's handler built to it (``check_engine_params``). Each rule answers in one wording on
both, the field named as each request names it (``sampling_params.x`` on the token API, ``x`` at the top of an
OpenAI body)."""

from __future__ import annotations

from typing import Any

import pytest

from app.core.protocol import ApiError, GenerateRequest
from app.engine.sampling import (
    NO_TOKENIZER_SERVER,
    TOKEN_API,
    Limits,
    build_sampling_params,
    check_engine_params,
    refuse_stop_strings,
)

LIMITS = Limits(vocab_size=512, max_model_len=64, max_num_seqs=4, max_logprobs=5, priority_scheduling=False,
                max_logit_bias=2, max_stop_token_ids=3)
PROMPT = [1, 2]

RULES: list[tuple[str, dict[str, Any]]] = [
    ("n above max_num_seqs", {"n": 5}),
    ("logprobs above max_logprobs", {"logprobs": 6}),
    ("logprobs of the whole vocabulary", {"logprobs": -1}),
    ("prompt_logprobs above max_logprobs", {"prompt_logprobs": 6}),
    ("stop id out of vocabulary", {"stop_token_ids": [600]}),
    ("allowed id out of vocabulary", {"allowed_token_ids": [3, 600]}),
    ("allowed_token_ids empty", {"allowed_token_ids": []}),
    ("too many stop ids", {"stop_token_ids": [1, 2, 3, 4]}),
    ("too many logit_bias entries", {"logit_bias": {1: 1.0, 2: 1.0, 3: 1.0}}),
    ("logit_bias id out of vocabulary", {"logit_bias": {600: 1.0}}),
    ("logit_bias not finite", {"logit_bias": {1: float("inf")}}),
    ("seed beyond 64 bits", {"seed": 2**70}),
    ("top_k beyond 64 bits", {"top_k": 2**64}),
]


def _token_api(sp: dict[str, Any], **req: Any) -> ApiError:
    body = {"token_ids": PROMPT, "sampling_params": sp, **req}
    with pytest.raises(ApiError) as e:
        build_sampling_params(GenerateRequest.model_validate(body), LIMITS)
    return e.value


def _openai(sp: dict[str, Any], *, priority: int = 0, tokenizer: bool = True) -> ApiError:
    from vllm.sampling_params import SamplingParams

    with pytest.raises(ApiError) as e:
        check_engine_params(SamplingParams(**sp), PROMPT, LIMITS, priority=priority, tokenizer=tokenizer)
    return e.value


@pytest.mark.parametrize(("case", "sp"), RULES, ids=[c for c, _ in RULES])
def test_each_rule_has_one_wording_on_the_token_api_and_the_openai_routes(case: str, sp: dict[str, Any]) -> None:
    tok, oai = _token_api(sp), _openai(sp)
    assert tok.status == oai.status == 400
    assert tok.param == "sampling_params." + str(oai.param), (tok.param, oai.param)
    assert tok.message.replace("sampling_params.", "") == oai.message, (tok.message, oai.message)


def test_max_tokens_past_the_context_is_said_the_same_way_everywhere() -> None:
    # check_params once said "must fit ... with max_tokens >= 1", the token API "exceeds": now one sentence. (On vLLM's
    # routes it is a guard: vLLM's handler refuses max_tokens above the context and clamps it to the room.)
    assert _openai({"max_tokens": 63}).message == \
        "prompt (2 tokens) + max_tokens (63) exceeds the model's maximum context length (64)."


def test_max_tokens_past_the_context_is_the_engines_on_the_token_api() -> None:
    """vLLM's token API (and Prime-RL's server) passes it on: the engine generates up to the context end and finishes
    with "length" (tests/test_generate.py runs it); only a prompt that alone fills the context is refused."""
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 63}}
    assert build_sampling_params(GenerateRequest.model_validate(body), LIMITS).max_tokens == 64 - len(PROMPT)


def test_priority_and_prompt_rules_are_shared() -> None:
    tok, oai = _token_api({}, priority=3), _openai({}, priority=3)
    assert tok.message == oai.message and tok.param == oai.param == "priority"
    from vllm.sampling_params import SamplingParams

    for ids, words in (([1, 600], "prompt contains token id 600, outside the vocabulary [0, 512)."),
                       ([1] * 64, "Input length (64) exceeds model's maximum context length (64)"),
                       ([], "prompt must not be empty.")):
        with pytest.raises(ApiError) as e:
            check_engine_params(SamplingParams(), ids, LIMITS, priority=0, tokenizer=True)
        assert e.value.param == "prompt" and words in e.value.message, e.value.message


def test_the_text_features_are_refused_in_one_wording_naming_who_cannot_serve_them() -> None:
    tok = _token_api({"stop": ["x"]})
    assert tok.message == refuse_stop_strings(TOKEN_API, "").message
    assert tok.message.startswith("stop strings need detokenization, which the token API does not do")
    oai = _openai({"stop": ["x"]}, tokenizer=False)
    assert (oai.message, oai.param) == (refuse_stop_strings(NO_TOKENIZER_SERVER, "").message, "stop")
    assert "this server does not do (it has no tokenizer" in oai.message
    for key, value in (("bad_words", ["x"]), ("structured_outputs", {"regex": "a+"})):
        tok = _token_api({key: value})
        assert tok.message.startswith(f"{key} needs a tokenizer, which the token API does not use"), tok.message
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    for params, key in ((SamplingParams(bad_words=["x"]), "bad_words"),
                        (SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")), "structured_outputs")):
        with pytest.raises(ApiError) as e:
            check_engine_params(params, PROMPT, LIMITS, priority=0, tokenizer=False)
        assert e.value.param == key and e.value.message.startswith(f"{key} needs a tokenizer, which this server")
    # With a tokenizer vLLM's routes serve them (the token API never does).
    check_engine_params(SamplingParams(stop=["x"], bad_words=["y"]), PROMPT, LIMITS, priority=0, tokenizer=True)
