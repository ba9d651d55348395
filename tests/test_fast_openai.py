"""Fast tests of the HTTP semantics of vLLM's OpenAI routes (routers/openai.py), /reset_prefix_cache and vLLM's keys
in /server_info, on the fake engine (tests/fake_engine.py, tests/fake_openai.py): admission and drain, in-flight
accounting, request identity, body checks, key planes. The real-engine tests (tests/test_openai.py, among them the text
routes' refusals on the tokens-only server; tests/test_trainers.py) are the evidence that the routes work."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

from tests.fake_engine import FACTS, FakeEngine, until
from tests.test_fast_http import serve

CMPL = "/v1/completions"
OK = {"prompt": [1, 2, 3], "max_tokens": 3}


def _with_tokenizer() -> FakeEngine:
    return FakeEngine(facts=replace(FACTS, tokenizer=True))


async def test_completions_json_and_stream_count_in_flight() -> None:
    async with serve() as (c, eng):
        r = await c.post(CMPL, json={**OK, "prompt": [[1, 2, 3], [7, 8]]}, headers={"X-Request-Id": "abc"})
        assert r.status_code == 200, r.text
        assert [ch["token_ids"] for ch in r.json()["choices"]] == [[4, 5, 6], [9, 10, 11]]
        engine_ids = r.headers["x-engine-request-id"].split(",")
        assert [e.rsplit("-", 1)[0] for e in engine_ids] == ["cmpl-abc-0", "cmpl-abc-1"]  # unique per request
        r = await c.post(CMPL, json={**OK, "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.text.splitlines() if line]
        assert events[-1] == "data: [DONE]"
        assert [t for e in events[:-1] for t in json.loads(e[6:])["choices"][0]["token_ids"]] == [4, 5, 6]
        assert (await c.get("/health")).json()["inflight"] == 0


async def test_drain_refuses_completions_and_waits_for_them() -> None:
    eng = FakeEngine()
    eng.gate.clear()
    async with serve(eng) as (c, _):
        running = asyncio.ensure_future(c.post(CMPL, json=OK))
        await until(lambda: eng.started > 0)
        assert (await c.get("/health")).json()["inflight"] == 1
        drain = await c.post("/drain", json={"timeout": 0.05})
        assert drain.json()["status"] == "timeout" and drain.json()["still_running"] == 1
        for path, body in ((CMPL, OK), ("/v1/chat/completions", {"messages": []})):
            refused = await c.post(path, json=body)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
        eng.gate.set()
        assert (await running).status_code == 200
        assert (await c.get("/health")).json()["inflight"] == 0
        await c.delete("/drain")


async def test_abort_by_the_completion_id() -> None:
    eng = FakeEngine()
    eng.gate.clear()
    async with serve(eng) as (c, _):
        running = asyncio.ensure_future(c.post(CMPL, json={**OK, "max_tokens": 50}, headers={"X-Request-Id": "r1"}))
        await until(lambda: eng.started > 0)
        r = await c.post("/abort_requests", json={"request_ids": ["r1"]})  # the bare id names cmpl-r1 too
        assert r.json() == {"status": "aborted", "aborted": 1}
        body = (await running).json()
        assert body["choices"][0]["finish_reason"] == "abort"


async def test_bad_bodies_are_4xx_before_the_engine() -> None:
    async with serve(max_body_bytes=2000) as (c, eng):
        cases: list[tuple[dict[str, Any], int]] = [
            ({"content": b"{}", "headers": {"Content-Type": "text/plain"}}, 400),
            ({"content": b"[" + b"1," * 1500 + b"1]", "headers": {"Content-Type": "application/json"}}, 413),
            ({"json": {"prompt": [1, 2, 600]}}, 400),
            ({"json": {"prompt": [1] * 600}}, 400),
            ({"content": b"{not json", "headers": {"Content-Type": "application/json"}}, 400),
        ]
        for kw, status in cases:
            r = await c.post(CMPL, **kw)
            assert r.status_code == status, (kw, r.text)
            assert r.json()["error"]["code"] == status
        r = await c.post(CMPL, json=OK, headers={"X-data-parallel-rank": "3"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-data-parallel-rank"
        assert eng.started == 0


async def test_keys_by_plane_for_the_new_routes() -> None:
    async with serve(_with_tokenizer(), api_key="data", admin_api_key="admin") as (c, _):
        data, admin = {"Authorization": "Bearer data"}, {"Authorization": "Bearer admin"}
        for path, body in ((CMPL, OK), ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert (await c.post(path, json=body)).status_code == 401
            assert (await c.post(path, json=body, headers=data)).status_code == 200, path
        assert (await c.post("/reset_prefix_cache", headers=data)).status_code == 401
        assert (await c.post("/reset_prefix_cache", headers=admin)).status_code == 200
        assert (await c.get("/server_info", headers=data)).status_code == 401


async def test_reset_prefix_cache_takes_vllms_query_and_skyrls_body() -> None:
    async with serve() as (c, eng):
        r = await c.post("/reset_prefix_cache")
        assert r.status_code == 200 and r.json() == {"success": True}
        await c.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        await c.post("/reset_prefix_cache", json={"reset_running_requests": True})
        await c.post("/reset_prefix_cache", params={"reset_running_requests": "false"},
                     json={"reset_running_requests": True})  # the query wins
        assert [a for n, a in eng.calls if n == "reset_prefix_cache"] == [False, True, True, False]
        for kw in ({"content": b"{bad", "headers": {"Content-Type": "application/json"}},
                   {"json": [1]}, {"json": {"reset_running_requests": "yes"}}):
            r = await c.post("/reset_prefix_cache", **kw)
            assert r.status_code == 400, r.text
        recent = (await c.get("/server_info")).json()["state"]["control"]["recent"]
        assert {"call": "reset_prefix_cache", "outcome": "ok"} in recent  # a control-plane transition


async def test_server_info_adds_the_engines_vllm_keys() -> None:
    """tito's /server_info puts the engine adapter's vLLM keys beside its own sections, in the format asked for (text
    by default, as vLLM's), and checks the format itself. The keys' values are vLLM's: test_openai.py checks them on a
    real engine."""
    async with serve() as (c, eng):
        for params, fmt in (({"config_format": "json"}, "json"), ({"config_format": "text"}, "text"), ({}, "text")):
            info = (await c.get("/server_info", params=params)).json()
            assert {k: info[k] for k in ("vllm_config", "vllm_env")} == eng.vllm_server_info(fmt), params
            assert info["schema_version"] == 1 and info["model"]["tokenizer_loaded"] is False
        r = await c.get("/server_info", params={"config_format": "yaml"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "query.config_format", r.text


async def test_any_client_id_makes_a_valid_engine_id_header() -> None:
    """A client id outside printable ASCII (any JSON string) is percent-encoded in X-Engine-Request-Id, which found a
    500 on the token API when the fuzz run sent one."""
    async with serve() as (c, _):
        r = await c.post("/inference/v1/generate", json={"token_ids": [1, 2], "request_id": "\U0008b541\n",
                                                         "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 200 and r.headers["x-engine-request-id"].startswith("generate-tokens-%F2%8B%95%81%0A-")
        r = await c.post(CMPL, json={**OK, "request_id": "é\r\n"})
        assert r.status_code == 200 and r.headers["x-engine-request-id"].startswith("cmpl-%C3%A9%0D%0A-0-")


async def test_a_client_that_leaves_a_completion_is_cancelled_and_frees_its_slot() -> None:
    """The disconnect watcher (app/server/requests.py ``Disconnect``) on vLLM's routes: a client that goes away while
    its completion runs cancels the call (the generation never finishes: its gate stays shut), its in-flight slot is
    released, and the answer nobody reads is 499."""
    from app.core.settings import Settings
    from tito.main import create_app

    eng = FakeEngine()
    eng.gate.clear()  # the generation waits after its first token until the test ends
    started = asyncio.Event()
    generate = eng.generate

    def generate_and_tell(*args: Any, **kwargs: Any) -> Any:
        started.set()
        return generate(*args, **kwargs)

    eng.generate = generate_and_tell  # type: ignore[method-assign]
    app = create_app(Settings.build(env={}, model="/models/fake", warmup=False), engine=eng)  # type: ignore[arg-type]
    body = json.dumps({**OK, "max_tokens": 50}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": CMPL, "raw_path": CMPL.encode(), "query_string": b"", "root_path": "",
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent: list[dict[str, Any]] = []
    unread = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if unread:
            return unread.pop()
        await started.wait()  # the client leaves once its completion is running
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    async with app.router.lifespan_context(app):
        call = asyncio.ensure_future(app(scope, receive, send))
        # Not wait_for: its cancellation at the timeout would itself end the call as the client's leaving does.
        done, _ = await asyncio.wait({call}, timeout=10)
        call.cancel()  # a no-op once done; else the failing test leaves no task behind
        assert call in done, "the call kept running after its client left"
        state = app.state.tito
        assert started.is_set() and state.inflight == 0 and not state.live
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499, sent
    assert json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]["message"] == "client disconnected"
