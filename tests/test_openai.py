"""vLLM's OpenAI routes on the real engine (routers/openai.py over vLLM's own handlers): the same tokens and logprobs
as the token API, streaming, echo, text prompts, chat, (de)tokenize; bad input a 4xx before the engine (stream or
not) and the engine serving afterwards; request identity (abort by the completion id); /reset_prefix_cache; the
tokens-only server (``keyed_tito``, ``--skip-tokenizer-init``). TRL's and SkyRL's clients: tests/test_trainers.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import ADMIN_KEY, DATA_KEY
from tests.helpers import ServerProcess, metric_value, restore_server

pytestmark = pytest.mark.engine

GEN = "/inference/v1/generate"
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Tell me"}]


@pytest.fixture(scope="module")
def c(tito: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tito.url, timeout=120.0) as client:
        yield client
    restore_server(tito.url)


def token_api(c: httpx.Client, ids: list[int], **sp: Any) -> dict[str, Any]:
    r = c.post(GEN, json={"token_ids": ids, "sampling_params": sp})
    assert r.status_code == 200, r.text
    body = r.json()
    body["choices"].sort(key=lambda ch: ch["index"])
    return dict(body)


def events(text: str) -> list[Any]:
    out = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(e) for e in out[:-1]]


def test_completions_equal_the_token_api(c: httpx.Client) -> None:
    prompts = [[1, 2, 3, 4, 5], [40, 41, 42]]
    r = c.post(CMPL, json={"prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 0.8, "seed": 9, "logprobs": 1,
                           "return_token_ids": True, "return_tokens_as_token_ids": True},
               headers={"X-Request-Id": "same-as-token-api"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "cmpl-same-as-token-api" and len(r.headers["x-engine-request-id"].split(",")) == 2
    for p, prompt in enumerate(prompts):
        ref = token_api(c, prompt, n=2, max_tokens=5, temperature=0.8, seed=9, logprobs=1)
        for k, want in enumerate(ref["choices"]):
            got = body["choices"][p * 2 + k]
            assert got["prompt_token_ids"] == prompt and got["token_ids"] == want["token_ids"]
            assert got["logprobs"]["tokens"] == [f"token_id:{t}" for t in want["token_ids"]]
            assert got["logprobs"]["token_logprobs"] == pytest.approx(
                [e["logprob"] for e in want["logprobs"]["content"]], abs=1e-4)
            assert got["weight_versions"] == want["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]
    assert body["usage"]["completion_tokens"] == 20 and "cached_tokens" in body["usage"]["prompt_tokens_details"]


def test_stream_echo_and_prompt_logprobs(c: httpx.Client) -> None:
    prompt = [7, 8, 9, 10]
    want = token_api(c, prompt, max_tokens=6, temperature=0, logprobs=0, prompt_logprobs=2)
    r = c.post(CMPL, json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True,
                           "return_token_ids": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    chunks = [e for e in evs if e["choices"]]
    assert [t for e in chunks for t in e["choices"][0]["token_ids"]] == want["choices"][0]["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    assert evs[-1]["usage"]["completion_tokens"] == 6
    # echo: the prompt's tokens and logprobs ahead of the completion's; prompt_logprobs as the token API's.
    r = c.post(CMPL, json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 0,
                           "prompt_logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True})
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt and choice["token_ids"] == want["choices"][0]["token_ids"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in prompt + choice["token_ids"]]  # echoed
    plp = want["prompt_logprobs"]
    assert [None if s is None else {k: v["logprob"] for k, v in s.items()} for s in choice["prompt_logprobs"]] == [
        None if s is None else pytest.approx({k: v["logprob"] for k, v in s.items()}, abs=1e-4) for s in plp]


def test_text_chat_and_tokenization(c: httpx.Client) -> None:
    ids = c.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert c.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}
    want = token_api(c, ids, max_tokens=5, temperature=0)["choices"][0]["token_ids"]
    r = c.post(CMPL, json={"prompt": "Hello world", "max_tokens": 5, "temperature": 0, "return_token_ids": True})
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == want
    assert choice["text"] == c.post("/detokenize", json={"tokens": want}).json()["prompt"]
    chat_ids = c.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert c.post(CHAT + "/render", json={"messages": MESSAGES}).json()["token_ids"] == chat_ids
    want = token_api(c, chat_ids, max_tokens=5, temperature=0)["choices"][0]["token_ids"]
    r = c.post(CHAT, json={"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "stream": True,
                           "return_token_ids": True})
    chunks = [e for e in events(r.text) if e["choices"]]
    assert [t for e in chunks for t in (e["choices"][0].get("token_ids") or [])] == want
    assert chunks[-1]["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]


BAD: list[tuple[str, str, dict[str, Any], int]] = [
    ("oov prompt id", CMPL, {"prompt": [1, 2, 100000]}, 400),
    ("negative prompt id", CMPL, {"prompt": [-1]}, 400),
    ("oov id in a batch", CMPL, {"prompt": [[1, 2], [3, 999]]}, 400),
    ("empty prompt", CMPL, {"prompt": []}, 400),
    ("prompt fills the context", CMPL, {"prompt": [1] * 512}, 400),
    ("max_tokens beyond the context", CMPL, {"prompt": [1, 2], "max_tokens": 2000}, 400),
    ("n above max_num_seqs", CMPL, {"prompt": [1, 2], "n": 100000}, 400),
    ("logprobs above max_logprobs", CMPL, {"prompt": [1, 2], "logprobs": 50}, 400),
    ("prompt_logprobs negative", CMPL, {"prompt": [1, 2], "prompt_logprobs": -5}, 400),
    ("oov stop id", CMPL, {"prompt": [1, 2], "stop_token_ids": [99999]}, 400),
    ("oov logit_bias id", CMPL, {"prompt": [1, 2], "logit_bias": {"99999": 1}}, 400),
    ("logit_bias key not an id", CMPL, {"prompt": [1, 2], "logit_bias": {"abc": 1}}, 400),
    ("empty allowed_token_ids", CMPL, {"prompt": [1, 2], "allowed_token_ids": []}, 400),
    ("oov allowed id", CMPL, {"prompt": [1, 2], "allowed_token_ids": [70000]}, 400),
    ("seed beyond 64 bits", CMPL, {"prompt": [1, 2], "seed": 2**70}, 400),
    ("top_k beyond 64 bits", CMPL, {"prompt": [1, 2], "top_k": 2**70}, 400),
    ("priority without priority scheduling", CMPL, {"prompt": [1, 2], "priority": 3}, 400),
    ("beam search", CMPL, {"prompt": [1, 2], "use_beam_search": True}, 400),
    ("unknown model", CMPL, {"prompt": [1, 2], "model": "nope"}, 404),
    ("prompt embeddings", CMPL, {"prompt": [1], "prompt_embeds": "AAAA"}, 400),
    ("wrong types", CMPL, {"prompt": {"a": 1}, "max_tokens": "many"}, 400),
    ("chat: messages not a list", CHAT, {"messages": "hello"}, 400),
    ("chat: image to a text model", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/x.png"}}]}]}, 400),
    ("chat: n above max_num_seqs", CHAT, {"messages": MESSAGES, "n": 100000}, 400),
    ("chat: top_logprobs above max_logprobs", CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50},
     400),
    ("detokenize: oov id", "/detokenize", {"tokens": [1, 100000]}, 400),
    ("tokenize: no prompt", "/tokenize", {"model": 3}, 400),
]


@pytest.mark.parametrize(("case", "path", "body", "status"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_before_the_engine(c: httpx.Client, case: str, path: str, body: dict[str, Any],
                                              status: int) -> None:
    for stream in ((False, True) if path in (CMPL, CHAT) else (False,)):
        r = c.post(path, json={**body, **({"stream": True} if stream else {})})
        assert r.status_code == status, (stream, r.text)
        assert r.headers["content-type"].startswith("application/json")  # refused before any stream started
        assert r.json()["error"]["code"] == status and r.json()["error"]["message"]


def test_the_engine_still_serves_after_bad_input(c: httpx.Client, tito: ServerProcess) -> None:
    assert c.get("/health").json() == {"status": "ok", "state": "serving", "inflight": 0}
    assert len(token_api(c, [1, 2, 3], max_tokens=4)["choices"][0]["token_ids"]) == 4
    assert "unhandled error" not in tito.log_text()
    text = c.get("/metrics").text
    assert (metric_value(text, "tito_requests_total", {"route": CMPL, "status": "400"}) or 0) >= 20


def test_abort_by_completion_id_answers_partial_tokens(c: httpx.Client) -> None:
    """Request identity: the completion's id (X-Request-Id) names its engine requests for /abort_requests."""
    assert c.post("/pause", params={"mode": "keep"}).status_code == 200
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(c.post, CMPL, json={"prompt": [1, 2, 3], "max_tokens": 50},
                              headers={"X-Request-Id": "to-abort"})
            deadline = time.monotonic() + 60
            while c.get("/health").json()["inflight"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert c.post("/abort_requests", json={"request_ids": ["cmpl-to-abort"]}).json() == {
                "status": "aborted", "aborted": 1}
            r = fut.result(timeout=60)
    finally:
        assert c.post("/resume").status_code == 200
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort"


def test_reset_prefix_cache_empties_the_cache(c: httpx.Client) -> None:
    prompt = [i % 500 + 1 for i in range(300)]  # whole KV blocks, so a prefix-cache hit is possible
    token_api(c, prompt, max_tokens=1)
    assert token_api(c, prompt, max_tokens=1)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert c.post("/reset_prefix_cache").json() == {"success": True}
    assert token_api(c, prompt, max_tokens=1)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert c.post("/reset_prefix_cache", json={"reset_running_requests": True}).json() == {"success": True}


def test_server_info_has_vllms_config(c: httpx.Client) -> None:
    info = c.get("/server_info", params={"config_format": "json"}).json()
    assert info["vllm_config"]["model_config"]["dtype"] == "torch.float32"
    assert info["vllm_config"]["weight_transfer_config"] is None
    assert info["vllm_config"]["model_config"]["max_model_len"] == info["model"]["max_model_len"]
    assert "VLLM_CPU_KVCACHE_SPACE" in info["vllm_env"]
    assert info["model"]["tokenizer_loaded"] is True and info["state"]["engine"] == "alive"


# ------------------------------------------------------------------------------------------------ tokens only


def test_a_tokens_only_server_serves_token_ids_and_refuses_text(keyed_tito: ServerProcess) -> None:
    data = {"Authorization": f"Bearer {DATA_KEY}"}
    with httpx.Client(base_url=keyed_tito.url, timeout=120.0, headers=data) as k:
        prompt = [5, 6, 7]
        want = token_api(k, prompt, max_tokens=4, temperature=0, logprobs=1)["choices"][0]
        r = k.post(CMPL, json={"prompt": [prompt, prompt], "max_tokens": 4, "temperature": 0, "logprobs": 1,
                               "return_token_ids": True, "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["token_ids"] == want["token_ids"] and choice["text"] == ""
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(
                [e["logprob"] for e in want["logprobs"]["content"]], abs=1e-4)
        r = k.post(CMPL, json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
                               "return_token_ids": True})
        assert [t for e in events(r.text) for t in e["choices"][0]["token_ids"]] == want["token_ids"]
        for path, body, param in ((CMPL, {"prompt": "hello"}, "prompt"), (CHAT, {"messages": MESSAGES}, None),
                                  ("/v1/chat/completions/render", {"messages": MESSAGES}, None),
                                  ("/tokenize", {"prompt": "x"}, None), ("/detokenize", {"tokens": [1]}, None),
                                  (CMPL, {"prompt": prompt, "stop": ["a"]}, "stop"),
                                  (CMPL, {"prompt": prompt, "echo": True}, "echo"),
                                  (CMPL, {"prompt": prompt, "logprobs": 1}, "return_tokens_as_token_ids")):
            r = k.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            err = r.json()["error"]
            assert "tokenizer" in err["message"] and (param is None or err["param"] == param)
        info = k.get("/server_info", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
        assert info["model"]["tokenizer_loaded"] is False and info["model"]["has_tokenizer"] is True
        assert k.get("/health").json()["inflight"] == 0
