"""Fast tests of tito's HTTP logic on a fake engine (tests/fake_engine.py): validation, admission and drain, auth,
error envelopes, LoRA orchestration, probes and the client. No vLLM engine starts; the real-engine tests remain the
evidence that features work."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.client import AsyncTitoClient, TitoError
from app.core.settings import Settings
from tests.fake_engine import FakeEngine, until
from tests.test_bad_input import CASES
from tito.main import create_app

GEN = "/inference/v1/generate"
OK = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, "temperature": 0}}


@asynccontextmanager
async def serve(engine: FakeEngine | None = None, **settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient,
                                                                                         FakeEngine]]:
    """The real app (create_app, lifespan, middleware, routers) on a fake engine, over an in-process transport."""
    engine = engine or FakeEngine()
    settings.setdefault("warmup", False)
    app = create_app(Settings.build(env={}, model="/models/fake", **settings), engine=engine)  # type: ignore[arg-type]
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tito") as c:
            yield c, engine


def test_the_fake_has_the_adapters_interface() -> None:
    """Every public method and property of app.engine.Engine, with the same parameter names: the fake cannot drift."""
    import inspect

    from app.engine.adapter import Engine

    members = {name: m for cls in reversed(Engine.__mro__[:-1]) for name, m in vars(cls).items()}  # inherited too
    assert "receive_broadcast" in members and "collective_rpc" in members
    for name, member in members.items():
        if name.startswith("_") or name in ("start", "start_control"):  # how a real one is built
            continue
        fake = getattr(FakeEngine, name, None)
        assert fake is not None, f"FakeEngine lacks {name}"
        if callable(member) and not isinstance(member, property):
            fn = member.__func__ if isinstance(member, staticmethod) else member
            assert list(inspect.signature(fake).parameters) == list(inspect.signature(fn).parameters), name


def _sse(text: str) -> list[Any]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]" for line in text.splitlines() if line]


async def test_generate_json_and_stream() -> None:
    async with serve() as (c, eng):
        r = await c.post(GEN, json=OK, headers={"X-Request-Id": "abc"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["request_id"] == "generate-tokens-abc" and body["model"] == "fake-model"
        assert body["choices"][0]["token_ids"] == [4, 5, 6] and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 3
        r = await c.post(GEN, json={**OK, "stream": True, "return_token_ids": True,
                                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        events = _sse(r.text)
        assert r.headers["content-type"].startswith("text/event-stream") and events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        assert [t for e in chunks for t in e["choices"][0]["token_ids"]] == [4, 5, 6]
        assert chunks[0]["prompt_token_ids"] == [1, 2, 3] and "prompt_token_ids" not in chunks[1]
        assert [e["usage"]["completion_tokens"] for e in chunks] == [1, 2, 3]
        assert events[-2]["choices"] == [] and events[-2]["usage"]["total_tokens"] == 6
        r = await c.get("/health")
        assert r.json() == {"status": "ok", "state": "serving", "inflight": 0}


@pytest.mark.parametrize("name,body,headers,status,param", CASES, ids=[c[0] for c in CASES])
async def test_bad_input_is_a_4xx_before_the_engine(name: str, body: Any, headers: dict[str, str], status: int,
                                                     param: str | None) -> None:
    async with serve() as (c, eng):
        if isinstance(body, bytes):
            r = await c.post(GEN, content=body, headers=headers)
        else:
            r = await c.post(GEN, json=body, headers=headers)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == status and err["message"]
        if param is not None:
            assert err["param"] == param
        assert eng.started == 0


async def test_body_limit_and_unknown_model() -> None:
    async with serve(max_body_bytes=1000) as (c, eng):
        r = await c.post(GEN, content=b"[" + b"1," * 600 + b"1]", headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "exceeds the limit of 1000 bytes" in r.json()["error"]["message"]
        r = await c.post(GEN, json={**OK, "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert eng.started == 0


async def test_drain_refuses_new_work_and_waits_for_inflight() -> None:
    eng = FakeEngine()
    eng.gate.clear()  # generations stop after their first token until released
    async with serve(eng) as (c, _):
        running = asyncio.ensure_future(c.post(GEN, json=OK))
        await until(lambda: eng.started > 0)
        drain = await c.post("/drain", json={"timeout": 0.05})
        assert drain.json()["status"] == "timeout" and drain.json()["still_running"] == 1
        refused = await c.post(GEN, json=OK)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert "draining" in refused.json()["error"]["message"]
        assert (await c.get("/ready")).json() == {"status": "not_ready", "reason": "draining"}
        eng.gate.set()
        assert (await running).status_code == 200
        status = (await c.get("/drain")).json()
        assert status["inflight"] == 0 and status["finished"] == 1
        assert (await c.delete("/drain")).json()["status"] == "admitting"
        assert (await c.post(GEN, json=OK)).status_code == 200


async def test_abort_by_client_id_answers_partial_tokens() -> None:
    eng = FakeEngine()
    eng.gate.clear()
    async with serve(eng) as (c, _):
        running = asyncio.ensure_future(c.post(GEN, json={**OK, "request_id": "r1",
                                                          "sampling_params": {"max_tokens": 10}}))
        await until(lambda: eng.started > 0)
        assert (await c.post("/abort_requests", json={"request_ids": ["r1"]})).json() == \
            {"status": "aborted", "aborted": 1}
        choice = (await running).json()["choices"][0]
        assert choice["finish_reason"] == "abort" and len(choice["token_ids"]) < 10
        # The engine saw the request under its own unique id (clients may share theirs): that one was aborted.
        assert len(eng.aborted) == 1 and eng.aborted[0].startswith("generate-tokens-r1-")
        assert eng.calls[0][1]["request_id"] == eng.aborted[0]


async def test_engine_errors_map_to_one_envelope() -> None:
    async with serve() as (c, eng):
        eng.fail_with = ValueError("bad seed")
        r = await c.post(GEN, json=OK)
        assert r.status_code == 400 and r.json()["error"]["message"] == "bad seed"
        eng.fail_with = RuntimeError("boom")
        r = await c.post(GEN, json=OK)
        assert r.status_code == 500 and r.json()["error"]["message"] == "generation failed: RuntimeError"
        r = await c.post(GEN, json={**OK, "stream": True})
        assert r.status_code == 200 and _sse(r.text)[0]["error"]["code"] == 500
        eng.errored = True
        r = await c.post(GEN, json=OK)
        assert r.status_code == 503 and r.json()["error"]["message"].startswith("engine is dead")
        assert (await c.get("/health")).status_code == 503
        assert (await c.get("/ready")).json()["reason"] == "engine_dead"
        assert (await c.get("/liveness")).json()["status"] == "engine_unresponsive"


async def test_liveness_times_out_on_a_hung_engine() -> None:
    async with serve(liveness_timeout=0.05) as (c, eng):
        assert (await c.get("/liveness")).json()["status"] == "ok"
        eng.ping_delay = 5.0
        r = await c.get("/liveness")
        assert r.status_code == 503 and r.json() == {"status": "engine_unresponsive", "error": "no answer within 0.05s"}


async def test_keys_by_plane() -> None:
    async with serve(api_key="data", admin_api_key="admin") as (c, _):
        assert (await c.post(GEN, json=OK)).status_code == 401
        assert (await c.post(GEN, json=OK, headers={"Authorization": "Bearer data"})).status_code == 200
        assert (await c.post("/pause", headers={"Authorization": "Bearer data"})).status_code in (401, 403)
        assert (await c.post("/pause", headers={"Authorization": "Bearer admin"})).status_code == 200
        assert (await c.get("/health")).status_code == 200


def _adapter(d: Path, rank: int = 4) -> Path:
    import torch
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8,
                                                        "target_modules": ["q_proj"]}))
    m = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{m}.lora_A.weight": torch.zeros(rank, 8), f"{m}.lora_B.weight": torch.zeros(8, rank)},
              str(d / "adapter_model.safetensors"))
    return d


async def test_lora_modules_are_served_from_the_start(tmp_path: Path) -> None:
    """vLLM's --lora-modules: each adapter goes through tito's own load (checked, registered) before the server is
    ready, and is served under its name."""
    from app.engine.vllm_args import parse_serve

    a = _adapter(tmp_path / "a")
    given = parse_serve(["--enable-lora", "--lora-modules", f"a={a}"], env={}).vllm_args
    eng = FakeEngine.with_lora()
    async with serve(eng, enable_lora=True, vllm_args=given) as (c, _):
        assert [x[1] for x in eng.calls if x[0] == "add_lora"] == [("a", 1, str(a), False)]
        names = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
        assert "a" in names, names
        r = await c.post(GEN, json={**OK, "model": "a"})
        assert r.status_code == 200, r.text


async def test_lora_orchestration(tmp_path: Path) -> None:
    eng = FakeEngine.with_lora()
    async with serve(eng, allowed_weight_root=[str(tmp_path)]) as (c, _):
        a = _adapter(tmp_path / "a")
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(a)})
        assert r.status_code == 200 and "added successfully" in r.text
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(a)})
        assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
        assert (await c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(a)})).status_code == 200
        # The reload went to the engine in place under the same id; the registry's handle never carries the flag.
        assert [x[1] for x in eng.calls if x[0] == "add_lora"] == [("a", 1, str(a), False), ("a", 1, str(a), True)]
        assert ("reset_prefix_cache", False) in eng.calls  # same path: no stale prefix cache
        view = (await c.get("/lora_adapters")).json()["data"][0]
        assert view["reloads"] == 1 and view["request"] == {"lora_name": "a", "lora_int_id": 1,
                                                            "lora_path": str(a), "load_inplace": False}
        r = await c.post(GEN, json={**OK, "model": "a"})
        assert r.json()["model"] == "a" and eng.calls[-1][1]["lora"].lora_int_id == 1
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["fake-model", "a"]
        eng.lora_refusal = "lm_head is not supported"
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(_adapter(tmp_path / "b"))})
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "the engine refused LoRA adapter 'b': lm_head is not supported", "type": "BadRequestError",
            "param": "lora_path", "code": 400}
        big = _adapter(tmp_path / "c", 32)
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(big)})
        assert r.status_code == 400 and "max_lora_rank 16" in r.json()["error"]["message"]
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": "/etc"})
        assert r.status_code == 403
        assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "a"})).status_code == 200
        assert (await c.post(GEN, json={**OK, "model": "a"})).status_code == 404
        assert ("remove_lora", 1) in eng.calls


async def test_lora_disabled_is_a_clear_400(tmp_path: Path) -> None:
    async with serve() as (c, _):
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path)})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


async def test_client_against_the_app() -> None:
    eng = FakeEngine()
    async with serve(eng, api_key="k") as (c, _):
        app = c._transport.app  # type: ignore[attr-defined]
        async with AsyncTitoClient("http://tito/v1", api_key="k", transport=httpx.ASGITransport(app=app)) as tc:
            out = await tc.generate([7, 8], max_tokens=2, request_id="q")
            assert out.token_ids == [9, 10] and out.request_id == "generate-tokens-q"
            deltas = [d async for d in tc.generate_stream([7, 8], max_tokens=2, include_usage=True)]
            assert [d.token_ids for d in deltas] == [[9], [10], []] and deltas[-1].usage.completion_tokens == 2
            with pytest.raises(TitoError) as e:
                await tc.generate([7, 999])
            assert e.value.status == 400 and e.value.param == "token_ids" and e.value.type == "BadRequestError"
            await tc.pause()
            assert await tc.is_paused() is True
            await tc.resume()
            assert (await tc.server_info())["model"]["served_model_name"] == "fake-model"
            assert "tito_requests_total" in await tc.metrics()
        async with AsyncTitoClient("http://tito", api_key="wrong", transport=httpx.ASGITransport(app=app)) as bad:
            with pytest.raises(TitoError) as e:
                await bad.generate([1])
            assert e.value.status == 401


async def test_status_capture_feeds_the_request_counter_and_the_request_log(caplog: pytest.LogCaptureFixture) -> None:
    """One status-capturing send (app.core.metrics.StatusSend) serves both middlewares."""
    import logging

    from prometheus_client import REGISTRY

    from app.server.reqlog import RequestLog

    def count(route: str, status: str) -> float:
        return REGISTRY.get_sample_value("tito_requests_total", {"route": route, "status": status}) or 0.0

    async with serve() as (c, _):
        # As `tito serve --log-requests` mounts it (before the first request builds the middleware stack).
        c._transport.app.add_middleware(RequestLog)  # type: ignore[attr-defined]
        before_ok, before_bad = count(GEN, "200"), count(GEN, "400")
        with caplog.at_level(logging.INFO, logger="tito.request"):
            assert (await c.post(GEN, json=OK, headers={"X-Request-Id": "logme"})).status_code == 200
            assert (await c.post(GEN, json={"token_ids": []})).status_code == 400
        assert count(GEN, "200") == before_ok + 1 and count(GEN, "400") == before_bad + 1
        lines = [(r.getMessage(), getattr(r, "request_id", None)) for r in caplog.records if r.name == "tito.request"]
        assert lines[0][0].startswith(f"POST {GEN} 200 ") and lines[0][1] == "generate-tokens-logme"
        assert lines[1][0].startswith(f"POST {GEN} 400 ")


@pytest.mark.parametrize("request_id", ["generate-tokens-abc", 'generate-tokens-"token_ids":[]', "generate-tokens-é\n"])
@pytest.mark.parametrize("index", [0, 3])
def test_plain_stream_events_are_the_general_form_byte_for_byte(request_id: str, index: int) -> None:
    """Mid-stream events come from a byte template (routers/generate_wire.py ``plain_event_parts``); the bytes must be
    exactly those of the general chunk, whatever the request id holds."""
    from types import SimpleNamespace

    import orjson

    from routers.generate_wire import choice, plain_event_parts, sse

    head, tail = plain_event_parts(request_id, index)
    for ids in ([7], [1, 2, 3, 4], list(range(500))):
        out = SimpleNamespace(index=index, finish_reason=None, stop_reason=None, token_ids=ids, weight_versions=None,
                              logprobs=None)
        general = sse({"request_id": request_id, "usage": None, "output_mode": "tokens",
                       "choices": [choice(out, None, final=False)]})  # type: ignore[arg-type]
        assert head + orjson.dumps(ids) + tail == general


async def test_stream_events_keep_the_general_key_order() -> None:
    """The served stream (template for mid-stream events, general form for the last) parses to the same keys in the
    same order for every event."""
    async with serve() as (c, _):
        r = await c.post(GEN, json={**OK, "stream": True})
    lines = [ln for ln in r.text.split("\n\n") if ln]
    assert lines[-1] == "data: [DONE]" and len(lines) == 4
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == [4, 5, 6]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "length"]
    keys = {tuple(e) for e in events}
    assert keys == {("request_id", "usage", "output_mode", "choices")}
    assert len({tuple(e["choices"][0]) for e in events}) == 1
