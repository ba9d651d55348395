"""Prime-RL's generate client (the `renderers` package, 0.1.12) parses tito's answers; vLLM 0.32's shape fails it."""

from __future__ import annotations

import copy

import httpx
import orjson
import pytest
from renderers.client import MalformedGenerateResponseError, _parse_completion_logprobs, parse_generate_response

pytestmark = pytest.mark.engine

GEN = "/inference/v1/generate"


def test_renderers_parses_tito_generate(tito_url):
    # The body Prime-RL's TrainClient sends (prime-rl-contract.md §1b): cache_salt and return_token_ids inside
    # sampling_params, top_k -1, logprobs 1, skip_special_tokens false.
    body = {"model": httpx.get(tito_url + "/v1/models").json()["data"][0]["id"], "token_ids": [1, 2, 3, 4],
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_tokens": 6,
                                "return_token_ids": True, "cache_salt": "0", "logprobs": 1,
                                "stop_token_ids": [2], "skip_special_tokens": False}}
    raw = httpx.post(tito_url + GEN, json=body, headers={"X-Session-ID": "trace-1"}).content
    data = parse_generate_response(raw)
    choice = data["choices"][0]
    ids = choice["token_ids"]
    assert ids
    lps = _parse_completion_logprobs(choice, ids)
    assert len(lps) == len(ids) and all(lp <= 0.0 for lp in lps)


def test_vllm_032_shape_is_rejected_by_renderers(tito_url):
    """The parser really checks the field: strip tito's compatibility keys and it fails as it does on vLLM 0.32."""
    raw = httpx.post(tito_url + GEN, json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2,
                                                                                   "logprobs": 1}}).content
    data = orjson.loads(raw)
    vllm_shape = copy.deepcopy(data)
    for entry in vllm_shape["choices"][0]["logprobs"]["content"]:
        entry.pop("token")
        entry.pop("bytes")
    with pytest.raises(MalformedGenerateResponseError, match="token must be 'token_id:"):
        _parse_completion_logprobs(vllm_shape["choices"][0], vllm_shape["choices"][0]["token_ids"])


def test_a_rollouts_last_turn_past_the_context_end_gets_the_tokens_that_fit(tito_url):
    """Two turns through renderers' own ``generate`` (its transport, pre-flight length check and parser), each turn's
    prompt the last one's prompt and completion plus new tokens, ``max_tokens`` 100 on every turn as Prime-RL sends
    it: the last turn (500-token prompt, 512-token context) gets the 12 tokens that fit and "length" (tito answered
    400 there, which verifiers turns into an overlong-prompt error that ends the rollout). The renderer stands in for
    a chat template only (the tiny model has none): ``prompt_ids`` are passed, as Prime-RL's multi-turn bridging
    does."""
    import asyncio
    from types import SimpleNamespace

    from openai import AsyncOpenAI
    from renderers.base import ParsedResponse
    from renderers.client import generate

    renderer = SimpleNamespace(get_stop_token_ids=lambda: [],
                               parse_response=lambda ids, **_: ParsedResponse(content=""))
    model = httpx.get(tito_url + "/v1/models").json()["data"][0]["id"]

    async def rollout() -> list[dict]:
        client = AsyncOpenAI(base_url=tito_url + "/v1", api_key="EMPTY", max_retries=0)
        turns, prompt = [], [(13 * i) % 500 + 3 for i in range(300)]
        try:
            for new in (100, 100):
                out = await generate(client=client, renderer=renderer, messages=[], model=model, prompt_ids=prompt,
                                     sampling_params={"temperature": 0.0, "max_tokens": 100, "ignore_eos": True})
                turns.append(out)
                prompt = prompt + out["completion_ids"] + [(7 * i) % 500 + 3 for i in range(new)]
        finally:
            await client.close()
        return turns

    first, last = asyncio.run(rollout())
    assert len(first["completion_ids"]) == 100 and first["finish_reason"] == "length"
    assert len(last["prompt_ids"]) == 500
    assert len(last["completion_ids"]) == 12 and last["finish_reason"] == "length"
    assert len(last["completion_logprobs"]) == 12
