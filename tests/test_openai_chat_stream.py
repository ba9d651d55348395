"""Streamed ``/v1/chat/completions`` (app/engine/openai_chat_stream.py): tito's generator writes vLLM's chunks without
a pydantic model per chunk. Held to vLLM's own generator byte for byte on the same engine outputs (no engine: vLLM's
handler code, the tiny model's tokenizer), including the servers it leaves to vLLM's generator (a parser, output
logging), and to vLLM's own server chunk for chunk on the real engine.
"""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest

from tests.helpers import ServerProcess
from tests.test_openai_stream import TINY, _aiter, _events, _lp, _per_choice, bare_handlers

CREATED = 1764800000.0

# ------------------------------------------------------------------------------------------------ byte for byte


def _handlers(**attrs: Any) -> tuple[Any, Any]:
    """vLLM's chat handler and tito's, built without an engine: only what their stream generators read."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    from app.engine.openai_chat_stream import chat_class

    chat = {"parser_cls": None, "_include_reasoning_tokens_details": False, "enable_log_outputs": False,
            "enable_log_deltas": True, "request_logger": None, "response_role": "assistant", "model_config": None}
    return bare_handlers(OpenAIServingChat, chat_class(), {**chat, **attrs})


def _outputs(tok: Any, n: int, steps: int, *, logprobs: bool = False, finish: str = "length", stop_reason: Any = None,
             empty_first: bool = False, missing: bool = False, stagger: bool = False,
             odd: bool = False) -> list[Any]:
    """What the engine client yields for one chat prompt x ``n`` choices over ``steps`` steps (delta outputs, text of
    1-2 tokens per step, non-ASCII and escapes included). ``missing``: some steps lack the sampled token's own
    logprob (or all logprobs); ``stagger``: choice 1 finishes a step early and is reported again after; ``odd``:
    logprobs of -inf and NaN, control characters in the text."""
    prompt = [3, 17, 42, 99, 5]
    events: list[Any] = []

    def res(outs: list[Any], cached: int = 2) -> Any:
        return SimpleNamespace(prompt_token_ids=prompt, encoder_prompt_token_ids=None, num_cached_tokens=cached,
                               num_cache_creation_tokens=None, prompt="<|im_start|>user\nHi", metrics=None,
                               outputs=outs)

    if empty_first:  # a chunked-prefill step: nothing generated yet
        events.append(res([SimpleNamespace(index=0, text="", token_ids=[], logprobs=[] if logprobs else None,
                                           finish_reason=None, stop_reason=None, spec_decode_metrics=None)]))
    for s in range(steps):
        outs = []
        for i in range(n):
            last = s == steps - 1 or (stagger and i == 1 and s >= steps - 2)
            ids = [(37 * s + 11 * i) % 400 + 20] + ([301] if s % 3 == 1 else [])
            lps = None
            if logprobs:
                lps = [_lp(tok, [t, t + 1, t + 2], -0.5 * s) for t in ids]
                if missing and s == 1:
                    lps[0] = {ids[0] + 5: lps[0][ids[0] + 1]}  # the sampled token not among them
                if missing and s == 2:
                    lps[0] = None
                if odd and s == 0:
                    from vllm.logprobs import Logprob

                    lps[0] = {ids[0]: Logprob(-math.inf, 1, "a"), ids[0] + 1: Logprob(math.nan, 2, None)}
            text = tok.decode(ids) + ("é\n\"😀" if s == 2 else "") + ("\x01\t\x7f\\" if odd and s == 1 else "")
            outs.append(SimpleNamespace(index=i, text=text, token_ids=ids, logprobs=lps,
                                        finish_reason=finish if last else None,
                                        stop_reason=stop_reason if last else None, spec_decode_metrics=None))
        events.append(res(outs))
    return events


async def _raising(items: list[Any]) -> Any:
    for x in items:
        yield x
    raise RuntimeError("the engine went away")


def _run(handler: Any, request: Any, events: Any, tok: Any, conversation: list[Any] | None = None) -> bytes:
    async def go() -> bytes:
        chunks = []
        gen = handler.chat_completion_stream_generator(
            request, events, "chatcmpl-abc", "tiny", conversation or [{"role": "user", "content": "Hi"}], tok,
            SimpleNamespace(final_usage_info=None))
        async for ev in gen:
            # What the layer sends: str (vLLM's), bytes, or a finishing chunk as a dict (dumped once its spans are
            # added; none here)
            chunks.append(ev.encode() if isinstance(ev, str) else ev if isinstance(ev, bytes)
                          else b"data: " + orjson.dumps(ev) + b"\n\n")
        return b"".join(chunks)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    if not (TINY / "tokenizer.json").is_file():
        pytest.skip("no tiny model: make model")
    return AutoTokenizer.from_pretrained(TINY)


@pytest.fixture(autouse=True)
def _fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: CREATED)  # both generators stamp "created" when they start


def _request(body: dict[str, Any]) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                                 "max_completion_tokens": 4, "stream": True, **body})


def _both(body: dict[str, Any], shape: dict[str, Any], tok: Any, steps: int = 4, raising: bool = False,
          conversation: list[Any] | None = None, **attrs: Any) -> tuple[bytes, bytes]:
    req = _request(body)
    events = _outputs(tok, req.n or 1, steps, **shape)
    theirs_h, ours_h = _handlers(**attrs)
    feed = (lambda: _raising(events)) if raising else (lambda: _aiter(events))
    return (_run(theirs_h, req, feed(), tok, conversation), _run(ours_h, req, feed(), tok, conversation))


USAGE = {"stream_options": {"include_usage": True}}
CONTINUOUS = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
CASES = [
    ("plain", {}, {}),
    ("usage", USAGE, {}),
    ("continuous usage", CONTINUOUS, {}),
    ("logprobs", {"logprobs": True, "top_logprobs": 2}, {"logprobs": True}),
    ("logprobs, no top", {"logprobs": True}, {"logprobs": True}),
    ("logprobs missing", {"logprobs": True, "top_logprobs": 1}, {"logprobs": True, "missing": True}),
    ("logprobs as token ids, return ids", {"logprobs": True, "top_logprobs": 3, "return_tokens_as_token_ids": True,
                                           "return_token_ids": True}, {"logprobs": True, "missing": True}),
    ("logprob token ids", {"logprobs": True, "logprob_token_ids": [7, 9]}, {"logprobs": True}),
    ("all top logprobs", {"logprobs": True, "top_logprobs": -1}, {"logprobs": True}),
    ("infinite, NaN, control characters", {"logprobs": True, "top_logprobs": 2}, {"logprobs": True, "odd": True}),
    ("n3, usage", {"n": 3, **USAGE}, {}),
    ("n2 staggered, continuous usage, ids", {"n": 2, "return_token_ids": True, **CONTINUOUS}, {"stagger": True}),
    ("prompt text and ids", {"return_prompt_text": True, "return_token_ids": True}, {}),
    ("stop string", {"stop": ["zz"]}, {"finish": "stop", "stop_reason": "zz"}),
    ("stop token", {}, {"finish": "stop", "stop_reason": 7}),
    ("abort", {}, {"finish": "abort"}),
    ("chunked prefill", {"logprobs": True}, {"empty_first": True, "logprobs": True}),
    ("error", USAGE, {"finish": "error"}),
    ("no generation prompt", {"add_generation_prompt": False, "continue_final_message": False,
                              "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "H"}]},
     {}),
]


@pytest.mark.parametrize("name,body,shape", CASES, ids=[c[0] for c in CASES])
def test_lean_chat_stream_is_vllms_byte_for_byte(tok: Any, name: str, body: dict[str, Any],
                                                 shape: dict[str, Any]) -> None:
    theirs, ours = _both(body, shape, tok)
    assert theirs.endswith(b"data: [DONE]\n\n") and theirs.count(b"data: ") >= 3
    assert (b'{"error"' in theirs) == (name == "error"), theirs
    assert ours == theirs


def test_a_failing_engine_stream_is_vllms_error_event(tok: Any) -> None:
    theirs, ours = _both(CONTINUOUS, {}, tok, raising=True)
    assert b"the engine went away" in theirs and theirs.endswith(b"data: [DONE]\n\n")
    assert ours == theirs


@pytest.mark.parametrize("conversation", [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "H"}],
                                          [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}],
                                          [{"role": "user", "content": "Hi"}]])
def test_echo_is_vllms(tok: Any, conversation: list[Any]) -> None:
    body = {"echo": True, "n": 2, "add_generation_prompt": False, "messages": conversation, **CONTINUOUS}
    theirs, ours = _both(body, {}, tok, conversation=conversation)
    assert (b'"content":"H"' in theirs) == (conversation[-1].get("content") == "H")
    assert ours == theirs


@pytest.mark.parametrize("attrs", [{"system_fingerprint": "fp_tito"}, {"enable_force_include_usage": True},
                                   {"enable_prompt_tokens_details": False}, {"enable_per_request_metrics": True},
                                   {"return_tokens_as_token_ids": True}])
def test_lean_chat_stream_server_options_byte_for_byte(tok: Any, attrs: dict[str, Any]) -> None:
    for body in ({}, USAGE, {"logprobs": True, "top_logprobs": 1, "n": 2}):
        theirs, ours = _both(body, {"logprobs": True}, tok, **attrs)
        assert b'{"error"' not in theirs and ours == theirs


class _Reasoner:
    """A parser as vLLM's handler makes one (``parser_cls(tokenizer, tools, ...)``): every delta is reasoning."""

    reasoning_parser = object()

    def __init__(self, tokenizer: Any, tools: Any, **kw: Any) -> None:
        pass

    def parse_delta(self, delta_text: str, **kw: Any) -> Any:
        from vllm.entrypoints.generate.base.protocol import DeltaMessage

        return DeltaMessage(reasoning=delta_text)

    def count_reasoning_tokens(self, ids: tuple[int, ...]) -> int:
        return len(ids)


class _Logger:
    def __init__(self) -> None:
        self.lines: list[Any] = []

    def log_outputs(self, **kw: Any) -> None:
        self.lines.append(kw)


@pytest.mark.parametrize("attrs", [{"parser_cls": _Reasoner}, {"parser_cls": _Reasoner,
                                                               "_include_reasoning_tokens_details": True},
                                   {"enable_log_outputs": True}], ids=["parser", "reasoning", "logging"])
def test_what_the_lean_stream_does_not_take_is_vllms_generator(tok: Any, attrs: dict[str, Any]) -> None:
    """A parser (tools, reasoning, harmony) or output logging: vLLM's own generator, the same events and the same
    log lines."""
    for body in (CONTINUOUS, {"logprobs": True, "top_logprobs": 1, "include_reasoning": False}):
        logs = (_Logger(), _Logger())
        extra = {**attrs}
        req = _request(body)
        events = _outputs(tok, 1, 4, logprobs=True)
        handlers = _handlers(**extra)
        for h, log in zip(handlers, logs, strict=True):
            h.request_logger = log
        assert not handlers[1].lean_stream()
        theirs, ours = (_run(h, req, _aiter(events), tok) for h in handlers)
        assert ours == theirs
        assert logs[0].lines == logs[1].lines
        assert (b'"reasoning"' in theirs) == ("parser_cls" in attrs)


def test_the_default_servers_streams_are_lean(tok: Any) -> None:
    _, ours_h = _handlers()
    assert ours_h.lean_stream()
    assert ours_h._lean_stream.__qualname__.startswith("chat_class.")


# ------------------------------------------------------------------------------------------------ real engine


def _approx_logprobs(lp: dict[str, Any] | None) -> Any:
    if lp is None:
        return None
    return {"content": [{**c, "logprob": pytest.approx(c["logprob"], abs=1e-4),
                         "top_logprobs": [{**t, "logprob": pytest.approx(t["logprob"], abs=1e-4)}
                                          for t in c["top_logprobs"]]} for c in lp["content"]]}


STREAMS = [
    ("logprobs, ids, continuous usage", {"messages": [{"role": "user", "content": "Hello there, how"}],
                                         "max_completion_tokens": 6, "temperature": 0, "logprobs": True,
                                         "top_logprobs": 2, "return_token_ids": True,
                                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("n2, seeded, usage", {"messages": [{"role": "system", "content": "Be terse."},
                                        {"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 5,
                           "temperature": 0.9, "seed": 4, "stream_options": {"include_usage": True}}),
    ("plain, a stop string", {"messages": [{"role": "user", "content": "Count: 1 2 3"}], "max_completion_tokens": 8,
                              "temperature": 0, "stop": ["zz"]}),
]


@pytest.mark.engine
@pytest.mark.parametrize("name,body", STREAMS, ids=[s[0] for s in STREAMS])
def test_chat_stream_same_as_vllms_server(tito: ServerProcess, vllm_ref: ServerProcess, name: str,
                                          body: dict[str, Any]) -> None:
    """tito's chat stream against vLLM's own server's, chunk for chunk per choice: every field equal (logprobs to
    1e-4, two engines' float32 sums) but the id, the creation time and what tito adds on purpose (``weight_versions``
    on the finishing chunk, the cached-token count in the usage)."""
    model = httpx.get(tito.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    answers = [httpx.post(u + "/v1/chat/completions", json={"model": model, "stream": True, **body}, timeout=120)
               for u in (tito.url, vllm_ref.url)]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert answers[0].text.endswith("data: [DONE]\n\n")
    ours, theirs = (_per_choice(_events(a.text)) for a in answers)
    assert sorted(ours, key=str) == sorted(theirs, key=str)
    for key, chunks in theirs.items():
        mine = ours[key]
        assert len(mine) == len(chunks), (key, mine, chunks)
        assert chunks[0]["choices"] == [] or chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        for a, b in zip(mine, chunks, strict=True):
            assert a.pop("id").startswith("chatcmpl-") and b.pop("id").startswith("chatcmpl-")
            assert isinstance(a.pop("created"), int) and isinstance(b.pop("created"), int)
            if a["choices"] and a["choices"][0]["finish_reason"] is not None:
                assert a["choices"][0].pop("weight_versions")[0]["version"] == "default"
            if key == "usage":
                a["usage"].pop("prompt_tokens_details")
            for c in b["choices"]:
                c["logprobs"] = _approx_logprobs(c["logprobs"])
            assert a == b
