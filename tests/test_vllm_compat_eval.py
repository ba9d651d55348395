"""The evaluation harnesses' routes, ``/v1/responses``, ``/v1/messages`` and ``/v1/messages/count_tokens``, side by side
with vLLM 0.32's own server (``vllm_ref``: the same tiny model, float32, with its tokenizer) for the same greedy
requests: the whole answer, field for field, but the per-request ids and creation times (``VOLATILE``); streams event
for event (runs of text deltas joined: how many tokens one delta carries depends on timing, on either server); errors
with the same status, envelope, type and parameter.

Tools: vLLM's server is started without a tool parser (``--tool-call-parser``, ``--enable-auto-tool-choice``), as
tito's eval routes are built. What that server serves is compared: function tools on ``/v1/responses`` (answered as
text), tool definitions and a tool-use history with ``tool_choice`` "none" on ``/v1/messages``, and the 400 both give
to an "auto" or a named tool choice there.

Where tito answers differently on purpose: a request its own checks refuse (a logprob cap, ...) is a 4xx before the
answer begins, also for a stream, where vLLM's server sends 200 and breaks the stream off; its messages for those and
for malformed bodies are worded its way (same status, type and parameter).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.helpers import ServerProcess

pytestmark = pytest.mark.engine

VOLATILE = {"id", "created_at", "item_id"}  # per-request ids and the creation time, on both servers
TOOL = {"name": "get_weather", "description": "The weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
FUNCTION = {"type": "function", "name": "get_weather", "description": "The weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "How are you?"}]
TOOL_HISTORY = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                                  {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": "Sunny, 21 C"}]}]


@pytest.fixture(scope="module")
def urls(tito: ServerProcess, vllm_ref: ServerProcess) -> tuple[str, str]:
    return tito.url, vllm_ref.url


@pytest.fixture(scope="module")
def model(urls: tuple[str, str]) -> str:
    names = [httpx.get(u + "/v1/models", timeout=30).json()["data"][0]["id"] for u in urls]
    assert names[0] == names[1]  # the same model directory, served under its path by both
    return str(names[0])


def ask(urls: tuple[str, str], path: str, body: dict[str, Any]) -> list[httpx.Response]:
    return [httpx.post(u + path, json=body, timeout=120) for u in urls]


def norm(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: "<volatile>" if k in VOLATILE and isinstance(v, str | int) else norm(v) for k, v in x.items()}
    if isinstance(x, list):
        return [norm(v) for v in x]
    return x


def differences(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Every difference between tito's answer and vLLM's (logprobs to 1e-4: two engines' float32 sums)."""
    if isinstance(theirs, dict) and isinstance(ours, dict):
        out = [f"{path}.{k}: missing" for k in theirs if k not in ours]
        out += [f"{path}.{k}: extra" for k in ours if k not in theirs]
        return out + [d for k in theirs if k in ours for d in differences(ours[k], theirs[k], f"{path}.{k}")]
    if isinstance(theirs, list) and isinstance(ours, list):
        if len(ours) != len(theirs):
            return [f"{path}: {len(ours)} items vs {len(theirs)}: {ours!r} vs {theirs!r}"]
        return [d for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) for d in differences(a, b, f"{path}[{i}]")]
    if isinstance(theirs, float) and isinstance(ours, float) and abs(ours - theirs) <= 1e-4:
        return []
    return [] if type(ours) is type(theirs) and ours == theirs else [f"{path}: {ours!r} vs {theirs!r}"]


def same(ours: httpx.Response, theirs: httpx.Response) -> dict[str, Any]:
    """Asserts tito's answer is vLLM's; returns vLLM's."""
    assert (ours.status_code, theirs.status_code) == (200, 200), (ours.text, theirs.text)
    assert differences(norm(ours.json()), norm(theirs.json())) == []
    return dict(theirs.json())


# ------------------------------------------------------------------------------------------------ /v1/responses

RESPONSES = [
    ("string input", {"input": "Hello there", "max_output_tokens": 8}),
    ("instructions, multi-turn", {"instructions": "You are terse.", "input": TURNS, "max_output_tokens": 6}),
    ("token ids, logprobs", {"input": [{"role": "user", "content": "Hello there, how are you?"}],
                             "max_output_tokens": 6, "enable_response_messages": True,
                             "include": ["message.output_text.logprobs"], "top_logprobs": 2}),
    ("function tool, no parser", {"input": "Weather in Paris?", "tools": [FUNCTION], "max_output_tokens": 6}),
]


@pytest.mark.parametrize("name,body", RESPONSES, ids=[r[0] for r in RESPONSES])
def test_responses_same_as_vllm(urls: tuple[str, str], model: str, name: str, body: dict[str, Any]) -> None:
    want = body.get("max_output_tokens")
    theirs = same(*ask(urls, "/v1/responses", {"model": model, "temperature": 0, **body}))
    assert theirs["status"] == "incomplete" and theirs["incomplete_details"] == {"reason": "max_output_tokens"}
    assert theirs["usage"]["output_tokens"] == want and theirs["output"][0]["content"][0]["text"]
    if body.get("enable_response_messages"):  # the prompt's and the answer's token ids, compared above
        assert len(theirs["input_messages"][0]["tokens"]) == theirs["usage"]["input_tokens"]
        assert len(theirs["output_messages"][0]["tokens"]) == want
        assert len(theirs["output"][0]["content"][0]["logprobs"]) == want


# ------------------------------------------------------------------------------------------------ /v1/messages

MESSAGES = [
    ("one turn", {"messages": [{"role": "user", "content": "Hello there, how are you?"}], "max_tokens": 10}),
    ("system, multi-turn", {"system": "You are terse.", "messages": TURNS, "max_tokens": 6}),
    ("tools, a tool-use history", {"system": [{"type": "text", "text": "You are terse."}], "tools": [TOOL],
                                   "tool_choice": {"type": "none"}, "messages": TOOL_HISTORY, "max_tokens": 5}),
]


@pytest.mark.parametrize("name,body", MESSAGES, ids=[m[0] for m in MESSAGES])
def test_messages_same_as_vllm(urls: tuple[str, str], model: str, name: str, body: dict[str, Any]) -> None:
    theirs = same(*ask(urls, "/v1/messages", {"model": model, "temperature": 0, **body}))
    assert theirs["stop_reason"] == "max_tokens" and theirs["usage"]["output_tokens"] == body["max_tokens"]
    assert [b["type"] for b in theirs["content"]] == ["text"] and theirs["content"][0]["text"]


def test_messages_stop_sequence_same_as_vllm(urls: tuple[str, str], model: str) -> None:
    body = {"model": model, "temperature": 0, "max_tokens": 8, "messages": [{"role": "user", "content": "Hello there"}]}
    text = httpx.post(urls[1] + "/v1/messages", json=body, timeout=120).json()["content"][0]["text"]
    stop = text[4:6]  # two characters in the middle of vLLM's greedy answer
    theirs = same(*ask(urls, "/v1/messages", {**body, "stop_sequences": [stop]}))
    assert theirs["stop_reason"] == "stop_sequence" and theirs["stop_sequence"] == stop
    assert text.startswith(theirs["content"][0]["text"]) and stop not in theirs["content"][0]["text"]


COUNTS = [
    {"messages": [{"role": "user", "content": "Hello there, how are you?"}]},
    {"system": "You are terse.", "messages": TURNS},
    {"system": [{"type": "text", "text": "You are terse."}], "tools": [TOOL], "tool_choice": {"type": "none"},
     "messages": TOOL_HISTORY},
]


@pytest.mark.parametrize("body", COUNTS, ids=["one turn", "system, multi-turn", "tools"])
def test_count_tokens_same_as_vllm(urls: tuple[str, str], model: str, body: dict[str, Any]) -> None:
    theirs = same(*ask(urls, "/v1/messages/count_tokens", {"model": model, **body}))
    answer = httpx.post(urls[1] + "/v1/messages", json={"model": model, "max_tokens": 1, **body}, timeout=120).json()
    assert theirs["input_tokens"] == answer["usage"]["input_tokens"] > 5


# ------------------------------------------------------------------------------------------------ streams


def sse(text: str) -> list[dict[str, Any]]:
    """An SSE body of named events as their data; each event's name is its data's type."""
    out = []
    for block in text.split("\n\n"):
        if block.strip():
            name, data = block.split("\n")
            assert name.startswith("event: ") and data.startswith("data: "), block
            out.append(json.loads(data[len("data: "):]))
            assert out[-1]["type"] == name[len("event: "):], block
    return out


def collapsed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``events`` normalized, each run of text deltas joined into one (texts and logprobs concatenated); a Responses
    stream's sequence numbers checked (0, 1, ...) and then dropped, since they count the deltas."""
    if any("sequence_number" in e for e in events):
        assert [e.pop("sequence_number") for e in events] == list(range(len(events)))
    out: list[dict[str, Any]] = []
    for e in map(norm, events):
        last = out[-1] if out else None
        if last and e["type"] == last["type"] == "response.output_text.delta":
            last["delta"] += e["delta"]
            last["logprobs"] += e["logprobs"]
        elif last and e["type"] == last["type"] == "content_block_delta" and e["index"] == last["index"]:
            last["delta"]["text"] += e["delta"]["text"]
        else:
            out.append(e)
    return out


STREAMS = [
    ("/v1/responses", {"input": TURNS, "instructions": "You are terse.", "max_output_tokens": 6,
                       "include": ["message.output_text.logprobs"], "top_logprobs": 2}),
    ("/v1/messages", {"system": "You are terse.", "messages": TURNS, "max_tokens": 6}),
]


@pytest.mark.parametrize("path,body", STREAMS, ids=["responses", "messages"])
def test_streams_same_as_vllm(urls: tuple[str, str], model: str, path: str, body: dict[str, Any]) -> None:
    body = {"model": model, "temperature": 0, **body}
    ours, theirs = ask(urls, path, {**body, "stream": True})
    assert (ours.status_code, theirs.status_code) == (200, 200), (ours.text, theirs.text)
    assert ours.headers["content-type"].startswith("text/event-stream")
    a, b = collapsed(sse(ours.text)), collapsed(sse(theirs.text))
    assert [e["type"] for e in a] == [e["type"] for e in b]
    assert differences(a, b) == []
    whole = httpx.post(urls[1] + path, json=body, timeout=120).json()  # the stream's text is the answer's
    if path == "/v1/responses":
        assert [e["type"] for e in b] == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            "response.output_text.delta", "response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.completed"]
        assert b[4]["delta"] == whole["output"][0]["content"][0]["text"]
        assert b[4]["logprobs"] and b[-1]["response"]["usage"]["output_tokens"] == body["max_output_tokens"]
        assert b[-1]["response"]["usage"] == whole["usage"]
    else:
        assert [e["type"] for e in b] == ["message_start", "content_block_start", "content_block_delta",
                                          "content_block_stop", "message_delta", "message_stop"]
        assert b[2]["delta"]["text"] == whole["content"][0]["text"]
        assert b[4]["delta"]["stop_reason"] == "max_tokens" and b[4]["usage"] == whole["usage"]


# ------------------------------------------------------------------------------------------------ errors

# (path, body, stream, the words both messages hold when tito words its own: None when vLLM's message is tito's)
ERRORS = [
    ("/v1/messages", {"messages": TURNS}, False, ["body.max_tokens"]),  # max_tokens is required
    ("/v1/messages", {"messages": TURNS, "max_tokens": 4, "model": "no-such-model"}, False, None),
    ("/v1/messages", {"messages": TURNS, "max_tokens": 10**9}, True, None),
    ("/v1/messages", {"messages": TURNS, "max_tokens": 4, "tools": [TOOL]}, False, None),  # "auto": no parser
    ("/v1/messages", {"messages": TURNS, "max_tokens": 4, "tools": [TOOL],
                      "tool_choice": {"type": "tool", "name": "get_weather"}}, False, None),
    ("/v1/messages", {"messages": TURNS, "max_tokens": 4, "top_k": -5}, True, None),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 4, "model": "no-such-model"}, False, None),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 10**9}, True, None),
    ("/v1/responses", {"input": " ".join(["hello"] * 700), "max_output_tokens": 4}, True, None),  # over the context
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 4, "top_logprobs": 30,
                       "include": ["message.output_text.logprobs"]}, False, ["logprobs", "30", "20"]),
    ("/v1/messages/count_tokens", {"messages": TURNS, "model": "no-such-model"}, False, None),
    ("/v1/messages/count_tokens", {}, False, ["body.messages"]),
]


@pytest.mark.parametrize("path,body,stream,words", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors_same_as_vllm(urls: tuple[str, str], model: str, path: str, body: dict[str, Any], stream: bool,
                             words: list[str] | None) -> None:
    ours, theirs = ask(urls, path, {"model": model, "temperature": 0, **body, **({"stream": True} if stream else {})})
    assert 400 <= theirs.status_code < 500 and ours.status_code == theirs.status_code, (ours.text, theirs.text)
    a, b = ours.json(), theirs.json()
    assert a.keys() == b.keys() and a["error"].keys() == b["error"].keys()  # Anthropic's envelope or OpenAI's
    assert a["error"]["type"] == b["error"]["type"] and a["error"].get("param") == b["error"].get("param")
    if words is None:
        assert a == b
    else:
        assert all(w in a["error"]["message"] and w in b["error"]["message"] for w in words), (a, b)


def test_a_refused_stream_is_a_4xx_before_the_answer(urls: tuple[str, str], model: str) -> None:
    """More logprobs than the server's cap in a Responses stream: tito answers 400 before the stream begins; vLLM's
    server submits to the engine only once its stream has begun, so it answers 200 and the stream breaks off."""
    body = {"model": model, "input": "Hi", "max_output_tokens": 4, "top_logprobs": 30, "stream": True,
            "include": ["message.output_text.logprobs"]}
    ours = httpx.post(urls[0] + "/v1/responses", json=body, timeout=120)
    assert ours.status_code == 400 and ours.json()["error"]["param"] == "logprobs", ours.text
    text = ""
    with httpx.stream("POST", urls[1] + "/v1/responses", json=body, timeout=120) as theirs:
        assert theirs.status_code == 200
        try:
            for chunk in theirs.iter_text():
                text += chunk
        except httpx.RemoteProtocolError:
            pass
    assert "event: response.created" in text and "response.completed" not in text
    assert httpx.get(urls[0] + "/health", timeout=30).json()["inflight"] == 0


# ------------------------------------------------------------------------------------------------ within tito


def test_responses_and_messages_equal_titos_chat_route(tito: ServerProcess, model: str) -> None:
    """On tito alone: the same text and token counts as its chat completions route for the same greedy request;
    count_tokens equals /tokenize of the chat template; nothing left in flight."""
    msgs = [{"role": "user", "content": "Hello there, how are you?"}]
    with httpx.Client(base_url=tito.url, timeout=120) as c:
        chat = c.post("/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": 10,
                                                    "temperature": 0})
        assert chat.status_code == 200, chat.text
        want, usage = chat.json()["choices"][0]["message"]["content"], chat.json()["usage"]
        ids = c.post("/tokenize", json={"model": model, "messages": msgs, "add_generation_prompt": True}).json()

        body = c.post("/v1/responses", json={"model": model, "input": msgs, "max_output_tokens": 10,
                                             "temperature": 0}).json()
        assert "".join(p["text"] for item in body["output"] if item["type"] == "message" for p in item["content"]) \
            == want
        assert body["usage"]["input_tokens"] == usage["prompt_tokens"] == ids["count"]
        assert body["usage"]["output_tokens"] == usage["completion_tokens"]

        body = c.post("/v1/messages", json={"model": model, "messages": msgs, "max_tokens": 10,
                                            "temperature": 0}).json()
        assert "".join(b["text"] for b in body["content"] if b["type"] == "text") == want
        assert (body["usage"]["input_tokens"], body["usage"]["output_tokens"]) == \
            (usage["prompt_tokens"], usage["completion_tokens"])

        r = c.post("/v1/messages/count_tokens", json={"model": model, "messages": msgs})
        assert r.status_code == 200 and r.json()["input_tokens"] == ids["count"], r.text
        assert c.get("/health").json()["inflight"] == 0
