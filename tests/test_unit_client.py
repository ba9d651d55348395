"""Fast tests (no engine): both clients build the same requests and share one retry policy (app/client/wire.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from app.client import AsyncTitoClient, TitoClient, TitoError

SSE = (b'data: {"request_id": "r", "usage": null, "choices": [{"index": 0, "token_ids": [5], "finish_reason": null}]}'
       b'\n\ndata: {"request_id": "r", "usage": null, "choices": [{"index": 0, "token_ids": [6], '
       b'"finish_reason": "length"}]}\n\ndata: [DONE]\n\n')


def _recorder(seen: list[httpx.Request], status: int = 200) -> httpx.MockTransport:
    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        if status >= 400:
            return httpx.Response(status, json={"error": {"message": "no", "type": "X", "param": None, "code": status}})
        if json.loads(req.content or b"{}").get("stream"):
            return httpx.Response(200, content=SSE, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"request_id": "r", "choices": [{"index": 0, "token_ids": [5, 6]}]})

    return httpx.MockTransport(handler)


KW = dict(max_tokens=2, temperature=0.0, logprobs=1, prompt_logprobs=1, request_id="rid", model="m",
          data_parallel_rank=0, return_token_ids=True)


async def test_sync_and_async_send_the_same_requests_for_every_generate_form() -> None:
    sync_seen: list[httpx.Request] = []
    async_seen: list[httpx.Request] = []
    with TitoClient("http://x", transport=_recorder(sync_seen)) as c:
        assert c.generate([1, 2], {"top_k": 3}, **KW).token_ids == [5, 6]
        assert [d.token_ids for d in c.generate_stream([1, 2], {"top_k": 3}, include_usage=True, **KW)] == [[5], [6]]
    async with AsyncTitoClient("http://x", transport=_recorder(async_seen)) as a:
        assert (await a.generate([1, 2], {"top_k": 3}, **KW)).token_ids == [5, 6]
        assert [d.token_ids async for d in a.generate_stream([1, 2], {"top_k": 3}, include_usage=True, **KW)] == \
            [[5], [6]]
    bodies = [json.loads(r.content) for r in sync_seen]
    assert bodies == [json.loads(r.content) for r in async_seen]
    assert [dict(r.headers).get("x-data-parallel-rank") for r in sync_seen] == ["0", "0"]
    # The stream's sampling params are the same as the non-streamed call's (prompt_logprobs included).
    assert bodies[0]["sampling_params"] == bodies[1]["sampling_params"] == {
        "top_k": 3, "max_tokens": 2, "temperature": 0.0, "logprobs": 1, "prompt_logprobs": 1}
    assert bodies[1]["stream"] is True and bodies[1]["stream_options"] == {"include_usage": True}
    assert bodies[1]["return_token_ids"] is True and bodies[0]["request_id"] == "rid"


def test_unknown_generate_keyword_is_a_type_error() -> None:
    with TitoClient("http://x", transport=_recorder([])) as c, pytest.raises(TypeError, match="max_token"):
        c.generate([1], max_token=3)  # type: ignore[call-arg]


def test_vllm_lora_load_is_not_retried_but_prime_rl_reload_is() -> None:
    seen: list[httpx.Request] = []
    with TitoClient("http://x", transport=_recorder(seen, 502), retries=2, backoff=0.001) as c:
        with pytest.raises(TitoError):
            c.load_lora("a", "/p", v1=True)  # a repeat would answer 400 "already loaded"
        assert [r.url.path for r in seen] == ["/v1/load_lora_adapter"]
        seen.clear()
        with pytest.raises(TitoError) as e:
            c.load_lora("a", "/p")
        assert [r.url.path for r in seen] == ["/load_lora_adapter"] * 3
        assert e.value.status == 502 and e.value.type == "X"
