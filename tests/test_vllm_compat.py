"""Side by side with vLLM 0.32's own token server on the same model: same tokens, same JSON keys and types.

tito's answers are a superset of vLLM's. The only differences allowed are the deliberate ones in ``EXTRA_OK``
(the ``token``/``bytes`` keys on logprob entries that older clients need) and ``NULL_OK`` (fields tito fills where
vLLM sends null).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import ServerProcess
from tests.test_generate import sse_events

pytestmark = pytest.mark.engine

GEN = "/inference/v1/generate"

# Keys tito adds on purpose (logprob compatibility keys; cached-token counts in the stream usage chunk).
EXTRA_OK = {"token", "bytes", "prompt_tokens_details"}
# Paths where vLLM answers null and tito answers an object.
NULL_OK = {"usage.prompt_tokens_details"}
# Values that legitimately differ between two servers.
VOLATILE = {"request_id", "created"}

BATTERY = [
    ("greedy", {"token_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_tokens": 6, "temperature": 0}}),
    ("seeded", {"token_ids": [9, 10, 11], "sampling_params": {"max_tokens": 8, "temperature": 0.9, "seed": 3}}),
    ("n2", {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 2}}),
    ("logprobs", {"token_ids": [20, 21, 22, 23], "sampling_params": {"max_tokens": 4, "temperature": 0,
                                                                     "logprobs": 3}}),
    # detokenize off: vLLM's reference loads the tokenizer (for its text routes) and would name each prompt token
    # (decoded_token); tito's token API never detokenizes, as vLLM's --tokens-only server.
    ("prompt_logprobs", {"token_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_tokens": 4, "temperature": 0,
                                                                           "logprobs": 1, "prompt_logprobs": 1,
                                                                           "detokenize": False}}),
    ("penalties", {"token_ids": [3, 3, 3, 3], "sampling_params": {"max_tokens": 6, "temperature": 0,
                                                                  "repetition_penalty": 1.3, "presence_penalty": 0.5}}),
    ("top_k_min_p", {"token_ids": [40, 41], "sampling_params": {"max_tokens": 6, "temperature": 0.7, "top_k": 5,
                                                                "min_p": 0.05, "seed": 5}}),
]


@pytest.fixture(scope="module")
def vllm_url(vllm_ref: ServerProcess) -> str:
    """vLLM's own server on the same tiny model (a shared session server, started beside tito's)."""
    return vllm_ref.url


def _diff(ours: object, theirs: object, path: str = "") -> list[str]:
    """Differences in shape (keys and JSON types) between tito's answer and vLLM's."""
    if isinstance(theirs, dict):
        if not isinstance(ours, dict):
            return [f"{path}: {type(ours).__name__} vs object"]
        out: list[str] = []
        for k in theirs:
            if k not in ours:
                out.append(f"{path}.{k}: missing")
            else:
                out += _diff(ours[k], theirs[k], f"{path}.{k}".lstrip("."))
        out += [f"{path}.{k}: extra" for k in ours if k not in theirs and k not in EXTRA_OK]
        return out
    if isinstance(theirs, list):
        if not isinstance(ours, list):
            return [f"{path}: {type(ours).__name__} vs list"]
        if len(ours) != len(theirs):
            return [f"{path}: length {len(ours)} vs {len(theirs)}"]
        return [d for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) for d in _diff(a, b, f"{path}[{i}]")]
    if theirs is None:
        if ours is not None and path.split("[")[0] not in NULL_OK and not any(path.startswith(p) for p in NULL_OK):
            return [f"{path}: {ours!r} vs null"]
        return []
    if type(ours) is not type(theirs) and not (isinstance(ours, float) and isinstance(theirs, int)):
        return [f"{path}: {type(ours).__name__} vs {type(theirs).__name__}"]
    return []


def _same_values(ours: dict, theirs: dict) -> None:
    assert ours["model"] == theirs["model"]
    assert len(ours["choices"]) == len(theirs["choices"])
    for a, b in zip(ours["choices"], theirs["choices"], strict=True):
        assert a["token_ids"] == b["token_ids"]
        assert a["finish_reason"] == b["finish_reason"]
        assert a["stop_reason"] == b["stop_reason"]
        assert a["weight_versions"] == b["weight_versions"]
        if b["logprobs"] is not None:
            for x, y in zip(a["logprobs"]["content"], b["logprobs"]["content"], strict=True):
                assert x["token_id"] == y["token_id"] and x["rank"] == y["rank"]
                assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)
                assert [t["token_id"] for t in x["top_logprobs"]] == [t["token_id"] for t in y["top_logprobs"]]
    assert {k: v for k, v in ours["usage"].items() if k != "prompt_tokens_details"} == \
        {k: v for k, v in theirs["usage"].items() if k != "prompt_tokens_details"}
    if theirs["prompt_logprobs"] is not None:
        for x, y in zip(ours["prompt_logprobs"], theirs["prompt_logprobs"], strict=True):
            assert (x is None) == (y is None)
            if y is not None:
                assert x.keys() == y.keys()
                for k in y:
                    assert x[k]["logprob"] == pytest.approx(y[k]["logprob"], abs=1e-4)
                    assert x[k]["rank"] == y[k]["rank"]


@pytest.mark.parametrize("name,body", BATTERY, ids=[b[0] for b in BATTERY])
def test_same_answer_as_vllm(tito_url: str, vllm_url: str, name: str, body: dict) -> None:
    ours = httpx.post(tito_url + GEN, json=body, timeout=60).json()
    theirs = httpx.post(vllm_url + GEN, json=body, timeout=60).json()
    assert _diff(ours, theirs) == []
    _same_values(ours, theirs)


def test_stop_token_ids_same_as_vllm(tito_url: str, vllm_url: str) -> None:
    probe = httpx.post(vllm_url + GEN, json={"token_ids": [30, 31], "sampling_params": {"max_tokens": 6,
                                                                                       "temperature": 0}}).json()
    stop = probe["choices"][0]["token_ids"][2]
    body = {"token_ids": [30, 31], "sampling_params": {"max_tokens": 6, "temperature": 0, "stop_token_ids": [stop]}}
    ours = httpx.post(tito_url + GEN, json=body).json()
    theirs = httpx.post(vllm_url + GEN, json=body).json()
    assert theirs["choices"][0]["finish_reason"] == "stop"
    assert _diff(ours, theirs) == []
    _same_values(ours, theirs)


def test_stream_with_usage_same_as_vllm(tito_url: str, vllm_url: str) -> None:
    body = {"token_ids": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True},
            "sampling_params": {"max_tokens": 5, "temperature": 0, "logprobs": 2}}
    ours = sse_events(httpx.post(tito_url + GEN, json=body, timeout=60).text)
    theirs = sse_events(httpx.post(vllm_url + GEN, json=body, timeout=60).text)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        if b == "[DONE]":
            assert a == "[DONE]"
            continue
        assert _diff(a, b) == [], json.dumps(b)
        assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
        assert [c["finish_reason"] for c in a["choices"]] == [c["finish_reason"] for c in b["choices"]]
    assert ours[-2]["usage"]["completion_tokens"] == theirs[-2]["usage"]["completion_tokens"] == 5


def test_models_card_same_shape_as_vllm(tito_url: str, vllm_url: str) -> None:
    ours = httpx.get(tito_url + "/v1/models").json()
    theirs = httpx.get(vllm_url + "/v1/models").json()
    assert ours["data"][0]["max_model_len"] == theirs["data"][0]["max_model_len"] == 512
    assert ours["data"][0]["id"] == theirs["data"][0]["id"]
    assert set(theirs["data"][0]) <= set(ours["data"][0])


# vLLM's OpenAI routes (served by vLLM's own handlers in tito): the same answer as vLLM's server, but for the keys
# tito adds (weight_versions on finished choices, cached-token counts). Both load the model's tokenizer: the same
# text, and the same names of the prompt's tokens.
COMPLETIONS = [
    ("batch n2 seeded", {"prompt": [[1, 2, 3, 4, 5], [9, 10]], "n": 2, "max_tokens": 5, "temperature": 0.9, "seed": 4,
                         "logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}),
    ("greedy prompt logprobs", {"prompt": [20, 21, 22, 23], "max_tokens": 4, "temperature": 0, "prompt_logprobs": 1,
                                "return_token_ids": True}),
]


@pytest.mark.parametrize("name,body", COMPLETIONS, ids=[b[0] for b in COMPLETIONS])
def test_completions_same_answer_as_vllm(tito_url: str, vllm_url: str, name: str, body: dict) -> None:
    ours = httpx.post(tito_url + "/v1/completions", json=body, timeout=60).json()
    theirs = httpx.post(vllm_url + "/v1/completions", json=body, timeout=60).json()
    for c in ours["choices"]:
        assert c.pop("weight_versions")[0]["version"] == "default"
    ours["usage"].pop("prompt_tokens_details")
    theirs["usage"].pop("prompt_tokens_details", None)
    # prompt_logprobs: compared below, to 1e-4 (keys of token ids: JSON types alone say little).
    plps = [(a.pop("prompt_logprobs"), b.pop("prompt_logprobs")) for a, b in zip(ours["choices"], theirs["choices"],
                                                                                 strict=True)]
    assert _diff(ours, theirs) == []
    for (a, b), (pa, pb) in zip(zip(ours["choices"], theirs["choices"], strict=True), plps, strict=True):
        a["prompt_logprobs"], b["prompt_logprobs"] = pa, pb
        assert a["token_ids"] == b["token_ids"] and a["prompt_token_ids"] == b["prompt_token_ids"]
        assert a["finish_reason"] == b["finish_reason"] and a["text"] == b["text"]
        if b["logprobs"] is not None:
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
            assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=1e-4)
        if b["prompt_logprobs"] is not None:
            assert [None if x is None else {k: v["logprob"] for k, v in x.items()} for x in a["prompt_logprobs"]] == [
                None if y is None else pytest.approx({k: v["logprob"] for k, v in y.items()}, abs=1e-4)
                for y in b["prompt_logprobs"]]
            names = [[None if x is None else {k: v["decoded_token"] for k, v in x.items()}
                      for x in p["prompt_logprobs"]] for p in (a, b)]
            assert names[0] == names[1]
    assert ours["usage"] == theirs["usage"]
