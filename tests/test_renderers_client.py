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
