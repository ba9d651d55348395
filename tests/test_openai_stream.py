"""Streamed ``/v1/completions`` (app/engine/openai_stream.py): tito's generator writes vLLM's chunks without a pydantic
model per chunk. Held to vLLM's own generator byte for byte on the same engine outputs (no engine: vLLM's handler
code, the tiny model's tokenizer), and to vLLM's own server event for event on the real engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest

from tests.helpers import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "tiny-qwen3"


# ------------------------------------------------------------------------------------------------ byte for byte


def _handlers(**attrs: Any) -> tuple[Any, Any]:
    """vLLM's completion handler and tito's, built without an engine: only what their stream generators read."""
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from app.engine.openai_stream import completion_class

    extract = {"_extract_prompt_text": lambda engine_input: f"<prompt of {len(engine_input['prompt_token_ids'])}> "}
    return bare_handlers(OpenAIServingCompletion, completion_class(), {**extract, **attrs})


def bare_handlers(theirs: type, ours: type, attrs: dict[str, Any]) -> tuple[Any, Any]:
    """vLLM's handler class and tito's as instances without ``__init__`` (no engine): the server options their
    stream generators read, at vLLM's defaults but for the cached-token count (tito's), then ``attrs``."""
    out = []
    for cls in (theirs, ours):
        h = object.__new__(cls)
        h.enable_force_include_usage = False
        h.enable_prompt_tokens_details = True
        h.enable_per_request_metrics = False
        h.return_tokens_as_token_ids = False
        h.system_fingerprint = None
        h.log_error_stack = False
        for k, v in attrs.items():
            setattr(h, k, v)
        out.append(h)
    return out[0], out[1]


def _lp(tok: Any, ids: list[int], base: float) -> dict[int, Any]:
    from vllm.logprobs import Logprob

    return {t: Logprob(logprob=base - 0.37 * j - 1e-5, rank=j + 1, decoded_token=tok.decode([t]))
            for j, t in enumerate(ids)}


def _outputs(tok: Any, prompts: list[list[int]], n: int, steps: int, *, logprobs: bool = False, finish: str = "length",
             stop_reason: Any = None, empty_first: bool = False) -> list[tuple[int, Any]]:
    """What merge_async_iterators yields for ``prompts`` x ``n`` choices over ``steps`` engine steps (delta outputs;
    text of 1-2 tokens per step, non-ASCII included): (prompt index, RequestOutput-like)."""
    events = []
    if empty_first:  # a chunked-prefill step: nothing generated yet
        events.append((0, SimpleNamespace(prompt_token_ids=prompts[0], prompt_logprobs=None, num_cached_tokens=3,
                                          prompt=None, metrics=None, outputs=[SimpleNamespace(
                                              index=0, text="", token_ids=[], logprobs=[] if logprobs else None,
                                              finish_reason=None, stop_reason=None, spec_decode_metrics=None)])))
    for s in range(steps):
        for p, prompt in enumerate(prompts):
            outs = []
            for i in range(n):
                ids = [(37 * s + 11 * i + 5 * p) % 400 + 20] + ([301] if s % 3 == 1 else [])
                last = s == steps - 1
                outs.append(SimpleNamespace(
                    index=i, text=tok.decode(ids) + ("é\n\"" if s == 2 else ""), token_ids=ids,
                    logprobs=[_lp(tok, [t, t + 1, t + 2], -0.5 * s) for t in ids] if logprobs else None,
                    finish_reason=finish if last else None, stop_reason=stop_reason if last else None,
                    spec_decode_metrics=None))
            plp = [None] + [_lp(tok, [t], -1.25) for t in prompt[1:]]
            events.append((p, SimpleNamespace(prompt_token_ids=prompt, prompt_logprobs=plp if logprobs else None,
                                              num_cached_tokens=2 * p, prompt=None, metrics=None, outputs=outs)))
    return events


async def _aiter(items: list[Any]) -> Any:
    for x in items:
        yield x


def _run(handler: Any, request: Any, prompts: list[list[int]], events: list[tuple[int, Any]], tok: Any) -> bytes:
    async def go() -> bytes:
        chunks = []
        inputs = [{"type": "token", "prompt_token_ids": p, "prompt": None} for p in prompts]
        async for ev in handler.completion_stream_generator(
                request, inputs, _aiter(events), "cmpl-abc", 1764800000, "tiny", num_prompts=len(prompts),
                tokenizer=tok, request_metadata=SimpleNamespace(final_usage_info=None)):
            # What the layer sends: str (vLLM's), bytes, or a finishing chunk as a dict (dumped once its spans are
            # added; none here)
            chunks.append(ev.encode() if isinstance(ev, str) else ev if isinstance(ev, bytes)
                          else b"data: " + orjson.dumps(ev) + b"\n\n")
        return b"".join(chunks)

    return asyncio.run(go())


CASES = [
    ("plain", {}, {}),
    ("usage", {"stream_options": {"include_usage": True}}, {}),
    ("continuous usage", {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, {}),
    ("logprobs", {"logprobs": 2}, {"logprobs": True}),
    ("logprobs as token ids, return ids", {"logprobs": 0, "return_tokens_as_token_ids": True,
                                           "return_token_ids": True}, {"logprobs": True}),
    ("n2 two prompts", {"n": 2, "prompt": [[1, 2, 3], [7, 8]], "stream_options": {"include_usage": True}}, {}),
    ("echo", {"echo": True, "logprobs": 1}, {"logprobs": True}),
    ("echo, return ids", {"echo": True, "return_token_ids": True}, {}),
    ("stop string", {"stop": ["zz"]}, {"finish": "stop", "stop_reason": "zz"}),
    ("stop token", {}, {"finish": "stop", "stop_reason": 7}),
    ("chunked prefill", {}, {"empty_first": True}),
    ("error", {}, {"finish": "error"}),
]


@pytest.mark.parametrize("name,body,shape", CASES, ids=[c[0] for c in CASES])
def test_lean_stream_is_vllms_byte_for_byte(name: str, body: dict[str, Any], shape: dict[str, Any]) -> None:
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    if not (TINY / "tokenizer.json").is_file():
        pytest.skip("no tiny model: make model")
    tok = AutoTokenizer.from_pretrained(TINY)
    req = CompletionRequest.model_validate({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True,
                                            **body})
    prompts = req.prompt if isinstance(req.prompt[0], list) else [req.prompt]
    events = _outputs(tok, prompts, req.n or 1, 4, **shape)
    theirs_h, ours_h = _handlers()
    theirs, ours = _run(theirs_h, req, prompts, events, tok), _run(ours_h, req, prompts, events, tok)
    assert theirs.endswith(b"data: [DONE]\n\n") and theirs.count(b"data: ") >= 2
    assert (b'{"error"' in theirs) == (name == "error"), theirs
    assert ours == theirs


@pytest.mark.parametrize("attrs", [{"system_fingerprint": "fp_tito"}, {"enable_force_include_usage": True},
                                   {"enable_prompt_tokens_details": False}])
def test_lean_stream_server_options_byte_for_byte(attrs: dict[str, Any]) -> None:
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    if not (TINY / "tokenizer.json").is_file():
        pytest.skip("no tiny model: make model")
    tok = AutoTokenizer.from_pretrained(TINY)
    for opts in (None, {"include_usage": True}):
        req = CompletionRequest.model_validate({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4,
                                                "stream": True, "stream_options": opts})
        events = _outputs(tok, [[1, 2, 3]], 1, 3, logprobs=False)
        theirs_h, ours_h = _handlers(**attrs)
        theirs = _run(theirs_h, req, [[1, 2, 3]], events, tok)
        assert b'{"error"' not in theirs and _run(ours_h, req, [[1, 2, 3]], events, tok) == theirs


# ------------------------------------------------------------------------------------------------ real engine


def _events(text: str) -> list[Any]:
    return [json.loads(b[len("data: "):]) if b != "data: [DONE]" else "[DONE]"
            for b in text.split("\n\n") if b.strip()]


def _per_choice(events: list[Any]) -> dict[Any, list[dict[str, Any]]]:
    """Each choice's chunks in order (choices of several prompts interleave by timing), the usage chunk apart."""
    out: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e == "[DONE]":
            continue
        key = e["choices"][0]["index"] if e["choices"] else "usage"
        out.setdefault(key, []).append(e)
    return out


STREAMS = [
    ("logprobs, echo, continuous usage", {"prompt": [20, 21, 22, 23], "max_tokens": 6, "temperature": 0,
                                          "logprobs": 2, "echo": True, "return_token_ids": True,
                                          "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("two prompts, n2, seeded", {"prompt": [[1, 2, 3, 4, 5], [9, 10]], "n": 2, "max_tokens": 5, "temperature": 0.9,
                                 "seed": 4, "stream_options": {"include_usage": True}}),
    ("text prompt", {"prompt": "Hello there, how", "max_tokens": 8, "temperature": 0}),
]


@pytest.mark.engine
@pytest.mark.parametrize("name,body", STREAMS, ids=[s[0] for s in STREAMS])
def test_stream_same_as_vllms_server(tito: ServerProcess, vllm_ref: ServerProcess, name: str,
                                     body: dict[str, Any]) -> None:
    """tito's stream against vLLM's own server's, chunk for chunk per choice: every field equal (logprobs to 1e-4,
    two engines' float32 sums) but the id, the creation time and what tito adds on purpose (``weight_versions`` on
    the finishing chunk, the cached-token count in the usage)."""
    model = httpx.get(tito.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    answers = [httpx.post(u + "/v1/completions", json={"model": model, "stream": True, **body}, timeout=120)
               for u in (tito.url, vllm_ref.url)]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    ours, theirs = (_per_choice(_events(a.text)) for a in answers)
    assert answers[0].text.endswith("data: [DONE]\n\n")
    assert sorted(ours, key=str) == sorted(theirs, key=str)
    for key, chunks in theirs.items():
        mine = ours[key]
        assert len(mine) == len(chunks), (key, mine, chunks)
        for a, b in zip(mine, chunks, strict=True):
            assert a.pop("id").startswith("cmpl-") and b.pop("id").startswith("cmpl-")
            assert isinstance(a.pop("created"), int) and isinstance(b.pop("created"), int)
            if a["choices"] and a["choices"][0]["finish_reason"] is not None:
                assert a["choices"][0].pop("weight_versions")[0]["version"] == "default"
            if key == "usage":
                a["usage"].pop("prompt_tokens_details")
            for c, d in zip(a["choices"], b["choices"], strict=True):
                if d["logprobs"] is not None:
                    mine_lp, their_lp = c["logprobs"], d["logprobs"]
                    assert mine_lp.pop("token_logprobs") == [
                        None if x is None else pytest.approx(x, abs=1e-4) for x in their_lp.pop("token_logprobs")]
                    assert mine_lp.pop("top_logprobs") == [
                        None if x is None else {k: pytest.approx(v, abs=1e-4) for k, v in x.items()}
                        for x in their_lp.pop("top_logprobs")]
            assert a == b


@pytest.mark.engine
def test_a_client_leaving_a_stream_frees_its_engine_request(tito: ServerProcess) -> None:
    """The lean SSE loop (routers/openai.py ``_Sse``): a client that closes its stream mid-way ends its engine request
    and frees its in-flight slot. The request is frozen in flight first (pause keep): it cannot end by itself, only by
    the client's leaving."""
    model = httpx.get(tito.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=tito.url, timeout=120) as c:
        try:
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                assert c.post("/pause", params={"mode": "keep"}).status_code == 200
                assert c.get("/health").json()["inflight"] == 1
            deadline = time.monotonic() + 60
            while c.get("/health").json()["inflight"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.get("/health").json()["inflight"] == 0
            assert c.get("/is_paused").json()["is_paused"] is True  # still frozen: only the leaving ended it
        finally:
            c.post("/resume")
