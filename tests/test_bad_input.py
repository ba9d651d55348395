"""Bad input never reaches the engine: each gets its 4xx in vLLM's envelope, and the engine keeps serving."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

GEN = "/inference/v1/generate"
OK = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "temperature": 0}}

CASES = [
    # (name, body or raw bytes, extra headers, status, param)
    ("out of vocabulary", {"token_ids": [100000], "sampling_params": {}}, {}, 400, "token_ids"),
    ("vocab edge", {"token_ids": [512], "sampling_params": {}}, {}, 400, "token_ids"),
    ("negative id", {"token_ids": [-1], "sampling_params": {}}, {}, 400, "token_ids"),
    ("empty ids", {"token_ids": [], "sampling_params": {}}, {}, 400, "body.token_ids"),
    ("missing ids", {"sampling_params": {}}, {}, 400, "body.token_ids"),
    ("ids not a list", {"token_ids": "1,2", "sampling_params": {}}, {}, 400, "body.token_ids"),
    ("id not an int", {"token_ids": [1, "x"], "sampling_params": {}}, {}, 400, "body.token_ids.1"),
    ("float id", {"token_ids": [1.5], "sampling_params": {}}, {}, 400, "body.token_ids.0"),
    ("prompt fills context", {"token_ids": [1] * 512, "sampling_params": {}}, {}, 400, "token_ids"),
    ("prompt over context", {"token_ids": [1] * 600, "sampling_params": {}}, {}, 400, "token_ids"),
    ("max_tokens zero", {"token_ids": [1], "sampling_params": {"max_tokens": 0}}, {}, 400,
     "sampling_params.max_tokens"),
    ("n too large", {"token_ids": [1], "sampling_params": {"n": 100000, "max_tokens": 1}}, {}, 400,
     "sampling_params.n"),
    ("n zero", {"token_ids": [1], "sampling_params": {"n": 0}}, {}, 400, "sampling_params.n"),
    ("logprobs too many", {"token_ids": [1], "sampling_params": {"logprobs": 21}}, {}, 400,
     "sampling_params.logprobs"),
    ("logprobs whole vocab", {"token_ids": [1], "sampling_params": {"logprobs": -1}}, {}, 400,
     "sampling_params.logprobs"),
    ("prompt_logprobs too many", {"token_ids": [1, 2], "sampling_params": {"prompt_logprobs": 50}}, {}, 400,
     "sampling_params.prompt_logprobs"),
    ("stop id out of vocab", {"token_ids": [1], "sampling_params": {"stop_token_ids": [9999]}}, {}, 400,
     "sampling_params.stop_token_ids"),
    ("logit_bias out of vocab", {"token_ids": [1], "sampling_params": {"logit_bias": {"70000": 1.0}}}, {}, 400,
     "sampling_params.logit_bias"),
    ("allowed ids out of vocab", {"token_ids": [1], "sampling_params": {"allowed_token_ids": [1, 600]}}, {}, 400,
     "sampling_params.allowed_token_ids"),
    ("priority without policy", {"token_ids": [1], "priority": 5, "sampling_params": {}}, {}, 400, "priority"),
    ("stop strings", {"token_ids": [1], "sampling_params": {"stop": ["x"]}}, {}, 400, "sampling_params.stop"),
    ("text mode", {"token_ids": [1], "output_mode": "text", "sampling_params": {}}, {}, 400, "output_mode"),
    ("bad temperature", {"token_ids": [1], "sampling_params": {"temperature": -1}}, {}, 400, None),
    ("bad top_p", {"token_ids": [1], "sampling_params": {"top_p": 5}}, {}, 400, None),
    ("temperature wrong type", {"token_ids": [1], "sampling_params": {"temperature": "hot"}}, {}, 400,
     "body.sampling_params.temperature"),
    ("sampling_params not object", {"token_ids": [1], "sampling_params": 7}, {}, 400, "body.sampling_params"),
    ("body not object", [1, 2, 3], {}, 400, None),
    ("non-JSON", b"{not json", {"Content-Type": "application/json"}, 400, "body"),
    ("wrong content type", b'{"token_ids":[1]}', {"Content-Type": "text/plain"}, 400, None),
    ("no content type", b'{"token_ids":[1]}', {"Content-Type": ""}, 400, None),
    ("bad dp rank", OK, {"X-data-parallel-rank": "x"}, 400, "X-data-parallel-rank"),
    ("dp rank out of range", OK, {"X-data-parallel-rank": "3"}, 400, "X-data-parallel-rank"),
    ("huge cache salt", {"token_ids": [1], "cache_salt": "s" * 5000, "sampling_params": {}}, {}, 400,
     "body.cache_salt"),
    # The default model is text-only: no media, whatever the shape (tests/test_multimodal.py has the VLM).
    ("content_parts to text model", {"token_ids": [1], "content_parts": [{"type": "image_url", "url": "data:,"}],
                                     "sampling_params": {}}, {}, 400, "content_parts"),
    ("features to text model", {"token_ids": [1], "features": {}, "sampling_params": {}}, {}, 400, "features"),
]


@pytest.mark.parametrize("name,body,headers,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_4xx_in_vllm_envelope(client, name, body, headers, status, param):
    if isinstance(body, bytes):
        r = client.post(GEN, content=body, headers=headers)
    else:
        r = client.post(GEN, json=body, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param


def test_oversized_body_is_413(client):
    big = b'{"token_ids":[' + b"1," * (5 * 1024 * 1024) + b'1]}'
    r = client.post(GEN, content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413


def test_engine_serves_after_a_burst_of_bad_requests(client, reference):
    for _name, body, headers, _status, _param in CASES * 2:
        if isinstance(body, bytes):
            client.post(GEN, content=body, headers=headers)
        else:
            client.post(GEN, json=body, headers=headers)
    r = client.post(GEN, json={"token_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_tokens": 4,
                                                                                 "temperature": 0}})
    assert r.status_code == 200
    assert r.json()["choices"][0]["token_ids"] == reference.greedy([1, 2, 3, 4, 5], 4)[0]
    assert client.get("/health").status_code == 200
