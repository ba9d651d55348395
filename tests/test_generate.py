"""/inference/v1/generate on the real engine: correctness against transformers, streaming, ids, defaults."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.engine

GEN = "/inference/v1/generate"
PROMPTS = [[1, 2, 3, 4, 5], [17, 300, 42], [7] * 12 + [400, 401, 402], list(range(100, 160))]


def _post(client: httpx.Client, body: dict, **kw) -> dict:
    r = client.post(GEN, json=body, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(text: str) -> list:
    """Parse an SSE body into JSON objects (and the final "[DONE]" string)."""
    out: list = []
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_and_logprobs_match_transformers(client, reference, prompt):
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 8, "temperature": 0, "logprobs": 1,
                                                       "prompt_logprobs": 1}}
    data = _post(client, body)
    choice = data["choices"][0]
    want_toks, want_lps = reference.greedy(prompt, 8)
    assert choice["token_ids"] == want_toks
    got_lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert got_lps == pytest.approx(want_lps, abs=1e-3)
    # prompt logprobs: position 0 has none; later positions hold the prompt token's own logprob.
    plp = data["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt)
    got_prompt = [plp[i][str(prompt[i])]["logprob"] for i in range(1, len(prompt))]
    assert got_prompt == pytest.approx(reference.prompt_logprobs(prompt), abs=1e-3)
    assert choice["finish_reason"] == "length"
    assert data["usage"]["prompt_tokens"] == len(prompt)
    assert data["usage"]["completion_tokens"] == 8


def test_logprob_entries_carry_both_client_generations(client):
    data = _post(client, {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, "temperature": 0,
                                                                       "logprobs": 3}})
    choice = data["choices"][0]
    for tid, entry in zip(choice["token_ids"], choice["logprobs"]["content"], strict=True):
        assert entry["token_id"] == tid
        assert entry["token"] == f"token_id:{tid}"
        assert entry["bytes"] is None
        assert entry["rank"] == 1  # greedy: the sampled token is the top one
        tops = entry["top_logprobs"]
        assert len(tops) == 3
        assert tops[0]["token_id"] == tid
        assert all(t["token"] == f"token_id:{t['token_id']}" for t in tops)
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)


def test_response_shape_matches_vllm_032(client):
    data = _post(client, {"token_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_tokens": 4, "temperature": 0}})
    assert data["request_id"].startswith("generate-tokens-")
    assert set(data) >= {"request_id", "model", "created", "usage", "prompt_logprobs", "prompt_token_id_logprobs",
                         "prompt_token_ids", "mm_placeholders", "metrics", "kv_transfer_params",
                         "ec_transfer_params", "output_mode", "choices"}
    assert data["output_mode"] == "tokens"
    c = data["choices"][0]
    assert set(c) == {"index", "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask",
                      "weight_versions", "logprobs"}
    assert c["weight_versions"] == [{"version": "default", "start": 0, "end": 4}]
    assert c["logprobs"] is None
    assert isinstance(data["usage"]["prompt_tokens_details"]["cached_tokens"], int)


def test_stream_concatenation_equals_non_stream(client):
    sp = {"max_tokens": 12, "temperature": 0, "logprobs": 2}
    full = _post(client, {"token_ids": [9, 8, 7, 6], "sampling_params": sp})
    r = client.post(GEN, json={"token_ids": [9, 8, 7, 6], "sampling_params": sp, "stream": True,
                               "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 12
    chunks = events[:-2]
    toks = [t for ch in chunks for t in ch["choices"][0]["token_ids"]]
    lps = [e for ch in chunks for e in ch["choices"][0]["logprobs"]["content"]]
    assert toks == full["choices"][0]["token_ids"]
    assert lps == full["choices"][0]["logprobs"]["content"]
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 12}]
    assert all(ch["choices"][0]["weight_versions"] is None for ch in chunks[:-1])


def test_stream_continuous_usage_and_no_usage(client):
    body = {"token_ids": [5, 6], "stream": True, "sampling_params": {"max_tokens": 3, "temperature": 0},
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(client.post(GEN, json=body).text)
    counts = [e["usage"]["completion_tokens"] for e in events[:-2]]
    assert counts == [1, 2, 3]
    body.pop("stream_options")
    events = sse_events(client.post(GEN, json=body).text)
    assert all(e["usage"] is None for e in events[:-1])
    assert all(e["choices"] for e in events[:-1])  # no usage-only chunk when not asked


def test_max_tokens_omitted_fills_the_context(client):
    prompt = list(range(1, 41))
    data = _post(client, {"token_ids": prompt, "sampling_params": {"temperature": 0, "ignore_eos": True}})
    assert len(data["choices"][0]["token_ids"]) == 512 - len(prompt)
    assert data["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_max_tokens_past_the_context_generates_to_its_end(client, vllm_ref, stream):
    """A turn whose prompt + max_tokens passes the context (Prime-RL sends max_tokens on every turn of a growing
    rollout) gets the tokens that fit and "length", as vLLM's own token API answers it; a prompt that alone fills the
    context stays a 400 (tests/test_bad_input.py)."""
    prompt = [(7 * i) % 500 + 3 for i in range(500)]
    body = {"token_ids": prompt, "stream": stream,
            "sampling_params": {"max_tokens": 100, "temperature": 0, "ignore_eos": True}}
    answers = []
    for url in (str(client.base_url), vllm_ref.url):
        r = httpx.post(url.rstrip("/") + GEN, json=body, timeout=120)
        assert r.status_code == 200, r.text
        if stream:
            events = [e for e in sse_events(r.text) if e != "[DONE]"]
            ids = [t for e in events for c in e["choices"] for t in c["token_ids"]]
            finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        else:
            choice = r.json()["choices"][0]
            ids, finish = choice["token_ids"], [choice["finish_reason"]]
        answers.append((ids, finish))
    (ids, finish), ref = answers
    assert len(ids) == 512 - 500 and finish == ["length"]
    assert (ids, finish) == ref


def test_request_id_header_overrides_body(client):
    data = _post(client, {"token_ids": [1, 2], "request_id": "body-id", "sampling_params": {"max_tokens": 1}})
    assert data["request_id"] == "generate-tokens-body-id"
    data = _post(client, {"token_ids": [1, 2], "request_id": "body-id", "sampling_params": {"max_tokens": 1}},
                 headers={"X-Request-Id": "hdr-id"})
    assert data["request_id"] == "generate-tokens-hdr-id"


def test_model_names(client):
    ok = client.get("/v1/models").json()["data"][0]["id"]
    assert _post(client, {"token_ids": [1], "model": ok, "sampling_params": {"max_tokens": 1}})["model"] == ok
    r = client.post(GEN, json={"token_ids": [1], "model": "nope", "sampling_params": {"max_tokens": 1}})
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                                 "param": "model", "code": 404}


def test_seeded_sampling_is_reproducible_and_n2(client):
    sp = {"max_tokens": 10, "temperature": 1.0, "seed": 7, "n": 2}
    a = _post(client, {"token_ids": [3, 4, 5], "sampling_params": sp})
    b = _post(client, {"token_ids": [3, 4, 5], "sampling_params": sp})
    assert [c["index"] for c in a["choices"]] == [0, 1]
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    assert a["usage"]["completion_tokens"] == 20
    c = _post(client, {"token_ids": [3, 4, 5], "sampling_params": {**sp, "seed": 8}})
    assert [x["token_ids"] for x in c["choices"]] != [x["token_ids"] for x in a["choices"]]


def test_stop_token_ids(client, reference):
    toks, _ = reference.greedy([11, 12, 13], 6)
    stop = toks[3]
    first = toks.index(stop)
    data = _post(client, {"token_ids": [11, 12, 13], "sampling_params": {"max_tokens": 6, "temperature": 0,
                                                                          "stop_token_ids": [stop]}})
    c = data["choices"][0]
    assert c["finish_reason"] == "stop"
    assert c["stop_reason"] == stop
    assert c["token_ids"][:first] == toks[:first]
    assert len(c["token_ids"]) <= first + 1


def test_cache_salt_and_kv_transfer_params_accepted(client):
    # Long enough to fill whole KV blocks (the CPU block size is large), so a prefix-cache hit can show.
    base = {"token_ids": [i % 500 + 1 for i in range(300)], "sampling_params": {"max_tokens": 2, "temperature": 0}}
    plain = _post(client, base)
    salted_top = _post(client, {**base, "cache_salt": "v1"})
    salted_sp = _post(client, {**base, "sampling_params": {**base["sampling_params"], "cache_salt": "v2",
                                                            "return_token_ids": True, "top_k": -1}})
    assert plain["choices"][0]["token_ids"] == salted_top["choices"][0]["token_ids"] == \
        salted_sp["choices"][0]["token_ids"]
    # A new salt never hits another salt's prefix cache.
    assert salted_top["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert salted_sp["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = _post(client, {**base, "cache_salt": "v1"})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    kv = _post(client, {**base, "kv_transfer_params": {"do_remote_prefill": False}})
    assert kv["kv_transfer_params"] == {"do_remote_prefill": False}


def test_return_token_ids_echoes_prompt(client):
    data = _post(client, {"token_ids": [4, 5, 6], "return_token_ids": True, "sampling_params": {"max_tokens": 1}})
    assert data["prompt_token_ids"] == [4, 5, 6]
    events = sse_events(client.post(GEN, json={"token_ids": [4, 5, 6], "stream": True, "return_token_ids": True,
                                               "sampling_params": {"max_tokens": 2}}).text)
    assert events[0]["prompt_token_ids"] == [4, 5, 6]
    assert "prompt_token_ids" not in events[1]
