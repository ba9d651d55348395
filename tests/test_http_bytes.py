"""The bytes of the generate route's answers, pinned: status, headers in order, body byte for byte, the Prometheus
counters each answer moved and what the engine was handed, for JSON and SSE answers, every error envelope on the
route's path (bad input, auth, body limit, content type, admission, engine failures) and both planes' keys.

``tests/golden/http_bytes.json`` was written by the FastAPI route from before the lean path, with
``scripts/write_golden.py`` (it asks for no ``lean=``, so a ``create_app`` without that argument takes it). Any change
to the wire then shows up here as a diff. Regenerate only for an intended wire change, from the route that defines it
(and say why in the commit).

Driven through ASGI (no sockets) on the fake engine, with an engine fake that also returns logprobs, prompt logprobs,
weight-version spans and cached-token counts so the general answer forms are covered too.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import REGISTRY

from app.core.settings import Settings
from tests.fake_engine import FakeEngine, FakeOutput, until
from tests.helpers import script_module
from tests.security_checks import GOLDEN, HOSTILE_NUMBERS, HOSTILE_RAW
from tests.test_bad_input import CASES as BAD_INPUT
from tito.main import create_app

GEN = "/inference/v1/generate"
JSON_CT = ("Content-Type", "application/json")


@dataclass
class Lp:
    logprob: float
    rank: int | None


@dataclass
class Span:
    version: str
    start: int
    end: int


class RichEngine(FakeEngine):
    """The fake engine, plus what a real one attaches when asked: logprobs (with a NaN and a -inf to clamp), prompt
    logprobs, weight-version spans (``extra_args: {"wv": 1}``), cached tokens, a KV connector's params."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.params: list[Any] = []  # the SamplingParams handed to generate

    def generate(self, token_ids: list[int], params: Any, request_id: str, **kw: Any) -> Any:  # type: ignore[override]
        self.params.append(params)
        return super().generate(token_ids, params, request_id, **kw)

    async def _run(self, prompt: list[int], params: Any, request_id: str) -> AsyncIterator[FakeOutput]:
        step = 0
        async for out in super()._run(prompt, params, request_id):
            out.num_cached_tokens = 2 if len(prompt) > 2 else 0
            if params.prompt_logprobs is not None:
                out.prompt_logprobs = [None] + [{t: Lp(-0.25 * k, k)} for k, t in enumerate(prompt[1:], 1)]
            if (params.extra_args or {}).get("kv_out"):
                out.kv_transfer_params = {"remote": "x"}
            for c in out.outputs:
                if params.logprobs is not None:
                    c.logprobs = [
                        {t: Lp(float("nan") if (step + j) % 5 == 3 else -0.5 - j, 1),
                         (t + 1) % 512: Lp(float("-inf") if j == 1 else -2.0, 2),
                         (t + 2) % 512: Lp(-3.125, 3)}
                        for j, t in enumerate(c.token_ids)]
                if (params.extra_args or {}).get("wv"):
                    c.weight_versions = [Span("v1", 0, max(len(c.token_ids) - 1, 0)),
                                         Span("v2", max(len(c.token_ids) - 1, 0), len(c.token_ids))]
            step += 1
            yield out


def _req(body: Any = None, *, raw: bytes | None = None, headers: dict[str, str] | None = None,
         chunks: int | None = None, method: str = "POST", path: str = GEN) -> dict[str, Any]:
    return {"body": body, "raw": raw, "headers": headers or {}, "chunks": chunks, "method": method, "path": path}


OK = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, "temperature": 0}}
RID = {"X-Request-Id": "golden"}

# (case id, settings variant, request)
DEFAULT: list[tuple[str, str, dict[str, Any]]] = [
    ("json", "default", _req(OK, headers=RID)),
    ("json body request_id", "default", _req({**OK, "request_id": "body-id"})),
    ("json header beats body id", "default", _req({**OK, "request_id": "body-id"}, headers=RID)),
    ("json n=2 seed", "default", _req({"token_ids": [7, 8], "sampling_params": {"n": 2, "seed": 3, "max_tokens": 2}},
                                      headers=RID)),
    ("json return_token_ids", "default", _req({**OK, "return_token_ids": True}, headers=RID)),
    ("json return_token_ids in sp", "default",
     _req({"token_ids": [5], "sampling_params": {"max_tokens": 1, "return_token_ids": True}}, headers=RID)),
    ("json logprobs", "default", _req({"token_ids": [4, 5, 6], "sampling_params": {"max_tokens": 4, "logprobs": 2}},
                                      headers=RID)),
    ("json logprobs 0", "default", _req({"token_ids": [4, 5], "sampling_params": {"max_tokens": 2, "logprobs": 0}},
                                        headers=RID)),
    ("json prompt logprobs", "default",
     _req({"token_ids": [9, 10, 11], "sampling_params": {"max_tokens": 1, "prompt_logprobs": 1}}, headers=RID)),
    ("json weight versions", "default",
     _req({"token_ids": [1], "sampling_params": {"max_tokens": 3, "extra_args": {"wv": 1}}}, headers=RID)),
    ("json kv params echoed", "default",
     _req({**OK, "kv_transfer_params": {"do_remote_prefill": False}, "cache_salt": "s"}, headers=RID)),
    ("json kv params from engine", "default",
     _req({"token_ids": [1, 2], "kv_transfer_params": {"a": 1},
           "sampling_params": {"max_tokens": 1, "extra_args": {"kv_out": 1}}}, headers=RID)),
    ("json salt in sp", "default",
     _req({"token_ids": [1, 2], "sampling_params": {"max_tokens": 1, "cache_salt": "p"}}, headers=RID)),
    ("json model by name", "default", _req({**OK, "model": "fake-model"}, headers=RID)),
    ("json model by path", "default", _req({**OK, "model": "/models/fake"}, headers=RID)),
    ("json max_tokens omitted", "default", _req({"token_ids": [1] * 500}, headers=RID)),
    ("json every sp key", "default", _req({"token_ids": [3, 4], "priority": 0, "stream": False, "output_mode": "tokens",
                                            "reasoning_ended": True, "token_offsets": None, "unknown_key": [1],
                                            "sampling_params": {
                                                "n": 1, "presence_penalty": 0.5, "frequency_penalty": 0.25,
                                                "repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.9,
                                                "top_k": 5, "min_p": 0.01, "seed": 42, "stop_token_ids": [7],
                                                "ignore_eos": True, "max_tokens": 2, "min_tokens": 1,
                                                "logprobs": 1, "prompt_logprobs": 0, "skip_special_tokens": True,
                                                "spaces_between_special_tokens": False,
                                                "include_stop_str_in_output": False, "logit_bias": {"5": -1.5},
                                                "allowed_token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "detokenize": True,
                                                "extra_args": {"x": [1, {"y": None}]},
                                                "skip_reading_prefix_cache": False, "stream_interval": 2,
                                                "routed_experts_prompt_start": 0, "flat_logprobs": False,
                                                "unknown": 1}}, headers=RID)),
    ("json float-valued ints", "default",
     _req({"token_ids": [1.0, 2], "sampling_params": {"max_tokens": 2.0}}, headers=RID)),
    ("json no request id", "default", _req(OK)),
    ("json dp rank 0", "default", _req(OK, headers={**RID, "X-data-parallel-rank": "0"})),
    ("json content-type params", "default",
     _req(raw=json.dumps(OK).encode(), headers={**RID, "Content-Type": "Application/JSON; charset=utf-8"})),
    ("json chunked body", "default", _req(OK, headers=RID, chunks=7)),
    ("json latin-1 request id", "default", _req({**OK, "request_id": "é\"\\"})),
    # Not latin-1: the X-Engine-Request-Id header carries it percent-encoded (protocol.header_value).
    ("json non-latin-1 request id", "default", _req({**OK, "request_id": "\u2028"})),
    ("stream non-latin-1 request id", "default", _req({**OK, "stream": True, "request_id": "\u2028"})),
    ("stream", "default", _req({**OK, "stream": True}, headers=RID)),
    ("stream usage", "default", _req({**OK, "stream": True, "stream_options": {"include_usage": True}}, headers=RID)),
    ("stream continuous usage ids", "default",
     _req({**OK, "stream": True, "return_token_ids": True,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, headers=RID)),
    ("stream continuous without include", "default",
     _req({**OK, "stream": True, "stream_options": {"continuous_usage_stats": True}}, headers=RID)),
    ("stream logprobs", "default",
     _req({"token_ids": [4, 5], "stream": True, "sampling_params": {"max_tokens": 4, "logprobs": 1}}, headers=RID)),
    ("stream n=2", "default",
     _req({"token_ids": [4, 5], "stream": True, "stream_options": {"include_usage": True},
           "sampling_params": {"max_tokens": 3, "n": 2}}, headers=RID)),
    ("stream weight versions", "default",
     _req({"token_ids": [4], "stream": True, "sampling_params": {"max_tokens": 3, "extra_args": {"wv": 1}}},
          headers=RID)),
    ("stream return ids", "default", _req({**OK, "stream": True, "return_token_ids": True}, headers=RID)),
    ("stream no request id", "default", _req({**OK, "stream": True})),
    ("stream odd request id", "default", _req({**OK, "stream": True, "request_id": 'x"token_ids":[]é'})),
    ("stream false explicit", "default", _req({**OK, "stream": False}, headers=RID)),
    ("unknown model", "default", _req({**OK, "model": "nope"}, headers=RID)),
    ("body limit by length", "small", _req({"token_ids": [1] * 600}, headers=RID)),
    ("body limit by chunks", "small", _req({"token_ids": [1] * 600}, headers=RID, chunks=50)),
    ("body at limit ok", "small", _req(raw=b'{"token_ids":[1],"sampling_params":{"max_tokens":1}}' + b" " * 947,
                                       headers={**RID, "Content-Type": "application/json"})),
    ("bad content-length", "default", _req(OK, headers={**RID, "Content-Length": "abc"})),
    ("negative content-length", "default", _req(OK, headers={**RID, "Content-Length": "-5"})),
    ("GET generate", "default", _req(method="GET")),
    ("PUT generate", "default", _req(OK, method="PUT")),
    ("trailing slash", "default", _req(OK, path=GEN + "/")),
    ("keyed no key", "keyed", _req(OK, headers=RID)),
    ("keyed wrong key", "keyed", _req(OK, headers={**RID, "Authorization": "Bearer nope"})),
    ("keyed not bearer", "keyed", _req(OK, headers={**RID, "Authorization": "Basic data-key"})),
    ("keyed data key", "keyed", _req(OK, headers={**RID, "Authorization": "Bearer data-key"})),
    ("keyed admin key", "keyed", _req(OK, headers={**RID, "Authorization": "bearer  admin-key "})),
    ("keyed stream", "keyed", _req({**OK, "stream": True}, headers={**RID, "Authorization": "Bearer data-key"})),
    ("keyed 401 before 413", "keyed_small", _req({"token_ids": [1] * 600}, headers=RID)),
    ("keyed pause with data key", "keyed", _req(path="/pause", headers={"Authorization": "Bearer data-key"})),
    ("draining", "draining", _req(OK, headers=RID)),
    ("shutting down", "shutting_down", _req(OK, headers=RID)),
    ("starting", "starting", _req(OK, headers=RID)),
    ("engine dead", "dead", _req(OK, headers=RID)),
    ("engine dead stream", "dead", _req({**OK, "stream": True}, headers=RID)),
    ("engine refuses", "refuses", _req(OK, headers=RID)),
    ("engine refuses stream", "refuses", _req({**OK, "stream": True}, headers=RID)),
    ("engine fails", "fails", _req(OK, headers=RID)),
    ("engine fails stream", "fails", _req({**OK, "stream": True}, headers=RID)),
    ("health", "default", _req(method="GET", path="/health")),
]
CASES = DEFAULT + [
    (f"bad input: {name}", "default",
     _req(raw=body, headers={**RID, **h}) if isinstance(body, bytes) else _req(body, headers={**RID, **h}))
    for name, body, h, _status, _param in BAD_INPUT
] + [
    (f"hostile: {json.dumps(sp)[:60]}", "default", _req({"token_ids": [1, 2], "sampling_params": sp}, headers=RID))
    for sp in HOSTILE_NUMBERS
] + [
    (f"hostile raw {i}", "default", _req(raw=raw, headers={**RID, "Content-Type": "application/json"}))
    for i, raw in enumerate(HOSTILE_RAW)
]

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "small": {"max_body_bytes": 1000},
    "keyed": {"api_key": "data-key", "admin_api_key": "admin-key"},
    "keyed_small": {"api_key": "data-key", "admin_api_key": "admin-key", "max_body_bytes": 1000},
}


def _metrics() -> dict[str, float]:
    out = {}
    for fam in REGISTRY.collect():
        if fam.name in ("tito_requests", "tito_rejected_requests"):
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[f"{s.name}{json.dumps(s.labels, sort_keys=True)}"] = s.value
    return out


def _params(p: Any) -> dict[str, str]:
    # What the engine was handed: every public SamplingParams field (skip_clone is vLLM's copy hint, not the request).
    return {f: repr(getattr(p, f)) for f in p.__struct_fields__ if not f.startswith("_") and f != "skip_clone"}


_NORMALIZE = [(re.compile(rb'"created":\d+'), b'"created":0'),
              (re.compile(rb"generate-tokens-[0-9a-f]{32}"), b"generate-tokens-<uuid>")]


def _norm(b: bytes) -> str:
    for pat, rep in _NORMALIZE:
        b = pat.sub(rep, b)
    return b.decode("latin-1")


async def call(app: Any, req: dict[str, Any]) -> tuple[int, list[list[str]], bytes, str | None]:
    """One request through the app's ASGI interface, as uvicorn makes it: the body in one message (or in ``chunks``
    pieces with no Content-Length), then ``http.disconnect`` once the answer is complete."""
    body = req["raw"] if req["raw"] is not None else (json.dumps(req["body"]).encode() if req["body"] is not None
                                                      else b"")
    headers = {k.lower(): v for k, v in req["headers"].items()}
    if req["body"] is not None:
        headers.setdefault("content-type", "application/json")
    if req["chunks"]:
        n = req["chunks"]
        parts = [body[i:i + n] for i in range(0, len(body), n)] or [b""]
        headers["transfer-encoding"] = "chunked"
    else:
        parts = [body]
        headers.setdefault("content-length", str(len(body)))
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": req["method"], "scheme": "http", "path": req["path"], "raw_path": req["path"].encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
             "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items() if v != ""]}
    ended = asyncio.Event()
    status = 0
    out_headers: list[list[str]] = []
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        if parts:
            piece = parts.pop(0)
            return {"type": "http.request", "body": piece, "more_body": bool(parts)}
        await ended.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        nonlocal status
        if msg["type"] == "http.response.start":
            status = msg["status"]
            out_headers.extend([k.decode("latin-1"), v.decode("latin-1")] for k, v in msg["headers"])
        elif msg["type"] == "http.response.body":
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                ended.set()

    raised = None
    try:
        await asyncio.wait_for(app(scope, receive, send), 30)
    except Exception as e:  # noqa: BLE001 - what the server (uvicorn) would see raised, after the answer
        raised = type(e).__name__
    ended.set()
    return status, out_headers, b"".join(chunks), raised


def _stack(lean: bool) -> dict[str, Any]:
    # Only asked for when off: the golden file is written by an implementation that has no lean path.
    return {} if lean else {"lean": False}


@asynccontextmanager
async def app_for(variant: str, lean: bool = True) -> AsyncIterator[tuple[Any, RichEngine]]:
    eng = RichEngine()
    settings = Settings.build(env={}, model="/models/fake", warmup=False,
                              **VARIANTS.get(variant, {}))  # type: ignore[arg-type]
    if variant == "starting":  # no lifespan: the engine is not up
        yield create_app(settings, engine=eng, **_stack(lean)), eng  # type: ignore[arg-type]
        return
    app = create_app(settings, engine=eng, **_stack(lean))  # type: ignore[arg-type]
    async with app.router.lifespan_context(app):
        state = app.state.tito
        if variant == "draining":
            state.start_drain()
        elif variant == "shutting_down":
            state.begin_shutdown()
        elif variant == "dead":
            eng.errored = True
        elif variant == "refuses":
            eng.fail_with = ValueError("the engine says no")
        elif variant == "fails":
            eng.fail_with = RuntimeError("boom")
        yield app, eng


async def run_case(variant: str, req: dict[str, Any], lean: bool = True) -> dict[str, Any]:
    async with app_for(variant, lean) as (app, eng):
        before = _metrics()
        status, headers, body, raised = await call(app, req)
        after = _metrics()
        moved = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
        handed = [{"request_id": _norm(c[1]["request_id"].encode()), "lora": c[1]["lora"], "rank": c[1]["rank"]}
                  for c in eng.calls if c[0] == "generate"]
        params = [_params(p) for p in eng.params]
        return {"status": status,
                "headers": [[k, _norm(v.encode())] for k, v in headers if k not in ("date", "server")],
                "body": _norm(body), "raised": raised, "metrics": moved, "engine": handed, "params": params}


def _load() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "stack"])
@pytest.mark.parametrize("name,variant,req", CASES, ids=[c[0] for c in CASES])
async def test_answer_is_byte_identical(name: str, variant: str, req: dict[str, Any], lean: bool) -> None:
    """Both ways the route is served (the lean path, and through the middleware stack) give the pinned answer."""
    golden = _load()
    assert name in golden, f"no golden answer for {name!r}: regenerate with scripts/write_golden.py"
    got = await run_case(variant, req, lean)
    want = golden[name]
    assert got["status"] == want["status"], (got["status"], got["body"][:300])
    assert got["headers"] == want["headers"]
    assert got["body"] == want["body"]
    assert got["raised"] == want["raised"]
    assert got["metrics"] == want["metrics"]
    assert got["engine"] == want["engine"]
    assert got["params"] == want["params"]


async def test_the_writer_script_reproduces_the_golden_file() -> None:
    """scripts/write_golden.py (the only writer of the file) renders it byte for byte from the route's answers. The
    answers themselves are ``test_answer_is_byte_identical``'s (every case, field for field): here each case's
    answer is the pinned one, so what is tested is the rest, the cases the script renders and how it writes them."""
    writer = script_module("write_golden")
    golden = _load()
    pinned = {id(req): golden[name] for name, _, req in CASES}

    async def answer(variant: str, req: dict[str, Any]) -> dict[str, Any]:
        return pinned[id(req)]

    writer.run_case = answer
    assert await writer.render() == GOLDEN.read_text()


def test_every_case_has_a_golden_answer() -> None:
    assert sorted(_load()) == sorted(name for name, _, _ in CASES)


# --------------------------------------------------------------------------------------------------- disconnects
# Not answers (nobody reads them) but what a client leaving does: the same on both paths.


async def _leave(app: Any, eng: RichEngine, body: dict[str, Any] | None, *, mid_body: bool = False
                 ) -> tuple[int, str | None, dict[str, float]]:
    """Send a request and go away: before the body ends (``mid_body``), or once the engine has started and is held
    at its gate. Returns the status sent (0: none), what the app raised, and the counters moved."""
    raw = json.dumps(body).encode() if body is not None else b'{"token_ids":'
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": GEN, "raw_path": GEN.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"gone")]}
    gone = asyncio.Event()
    sent: list[bytes] = []
    step = 0
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal step
        step += 1
        if step == 1:
            return {"type": "http.request", "body": raw, "more_body": mid_body}
        if not mid_body:
            await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        nonlocal status
        if msg["type"] == "http.response.start":
            status = msg["status"]
        else:
            sent.append(msg.get("body", b""))

    eng.gate.clear()  # generation holds after its first token
    before = _metrics()
    task = asyncio.ensure_future(app(scope, receive, send))
    if not mid_body:
        await until(lambda: eng.held == 1)  # its first token made (and, streaming, sent), held at the gate
        gone.set()
    raised = None
    try:
        await asyncio.wait_for(task, 10)
    except Exception as e:  # noqa: BLE001
        raised = type(e).__name__
    after = _metrics()
    return status, raised, {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "stack"])
@pytest.mark.parametrize("kind", ["mid-body", "json", "stream"])
async def test_a_client_leaving_is_handled_alike(kind: str, lean: bool) -> None:
    route = '{"route": "/inference/v1/generate", "status": "%s"}'
    async with app_for("default", lean) as (app, eng):
        body = None if kind == "mid-body" else {**OK, "stream": kind == "stream",
                                                 "sampling_params": {"max_tokens": 10}}
        status, raised, moved = await _leave(app, eng, body, mid_body=kind == "mid-body")
        state = app.state.tito
        # The abort runs in the background: wait until the request has left (and, past the body, was aborted).
        await until(lambda: state.inflight == 0 and not state.live and (kind == "mid-body" or bool(eng.aborted)))
        if kind == "mid-body":  # Starlette's ClientDisconnect, answered as an unexpected error
            assert (status, raised) == (500, "ClientDisconnect") and eng.started == 0
            assert moved == {"tito_requests_total" + route % 500: 1.0}
        elif kind == "json":  # the engine request is aborted; the answer nobody reads is a 499
            assert (status, raised) == (499, None)
            assert eng.aborted and eng.aborted[0].startswith("generate-tokens-gone-")
            assert moved == {"tito_requests_total" + route % 499: 1.0,
                             'tito_rejected_requests_total{"reason": "other_4xx"}': 1.0}
        else:  # mid-stream: the engine request is aborted, the request counted with its 200
            assert (status, raised) == (200, None)
            assert eng.aborted and eng.aborted[0].startswith("generate-tokens-gone-")
            assert moved == {"tito_requests_total" + route % 200: 1.0}


def test_routed_experts_are_sent_as_vllms_token_api_sends_them_with_the_npy_format() -> None:
    """With --enable-return-routed-experts (GPU only) and ``--routed-experts-format npy`` the engine's array goes out
    as vLLM's token API sends it: base64 of its ``.npy`` bytes; without it the field stays null (the default, Prime-RL's
    form: tests/test_routed_experts_wire.py)."""
    import base64
    import io
    from types import SimpleNamespace

    import numpy as np
    from vllm.utils.serial_utils import numpy2base64

    from routers.generate_wire import choice

    experts = np.arange(24, dtype=np.uint8).reshape(4, 2, 3)  # (tokens - 1, MoE layers, top k)
    out = SimpleNamespace(index=0, finish_reason="length", stop_reason=None, token_ids=[1, 2, 3, 4, 5],
                          weight_versions=None, logprobs=None, routed_experts=experts)
    sent = choice(out, None, final=True, experts=(0, "npy"))["routed_experts"]  # type: ignore[arg-type]
    assert sent == numpy2base64(experts)
    assert np.array_equal(np.load(io.BytesIO(base64.b64decode(sent))), experts)
    out.routed_experts = None
    assert choice(out, None, final=True, experts=(0, "npy"))["routed_experts"] is None  # type: ignore[arg-type]
    assert choice(out, None, final=True)["routed_experts"] is None  # type: ignore[arg-type]
