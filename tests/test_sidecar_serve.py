"""tito under Dynamo through Dynamo's own vLLM sidecar (ai-dynamo 1.6.1; file discovery, no etcd/NATS), end to end:
two real replicas (the shared ``sidecar_a`` / ``sidecar_b``), each with a sidecar started by hand as the docs show
(``python -m dynamo.vllm.sidecar --grpc-endpoint ... --enable-rl --vllm-http-endpoint ...``), and Dynamo's frontend
in ``--router-mode kv`` with RL discovery.

OpenAI completions and chat (JSON and SSE) and Dynamo's ``/inference/v1/generate`` answer with tito's greedy tokens;
the KV router sends a prefix to the replica that cached it; a client leaving the frontend frees the engine; engine
control and LoRA through the sidecar's system port show in tito's own state; ``/v1/rl/workers`` lists each replica's
HTTP admin URL and world size, and a trainer loop finds them there and updates weights three times; draining one
replica and shutting the other down (``vllm.Control/Shutdown``) under load fails no request. The shutdown runs last.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file

from app.grpc.proto import vllm_control_pb2 as cpb
from app.tiny.model import tiny_state_dict
from tests.helpers import TIMING, ServerProcess, metric_value, restore_server
from tests.sidecar import (
    BLOCK,
    MODEL,
    child_system_url,
    control,
    dynamo_available,
    dynamo_env,
    dynamo_kv_dir,
    model_dir,
    models_listed,
    rl_workers,
    start_frontend,
    start_sidecar,
    wait_for,
)
from tests.streaming import GEN

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not dynamo_available(), reason="Dynamo (ai-dynamo + ai-dynamo-runtime) is not "
                                 "installed; `make test` installs it")]
PROMPTS = [[17, 250, 33, 401, 9, 77], [1, 300, 301, 302]]


@pytest.fixture(scope="module")
def replicas(sidecar_a: ServerProcess, sidecar_b: ServerProcess) -> Iterator[list[ServerProcess]]:
    yield [sidecar_a, sidecar_b]
    restore_server(sidecar_a.url)  # b is shut down by the last test


@pytest.fixture(scope="module")
def dyn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return dynamo_env(dynamo_kv_dir(tmp_path_factory.getbasetemp()))  # the directory b's own sidecar uses too


@pytest.fixture(scope="module")
def hand_sidecar(replicas: list[ServerProcess], dyn: dict[str, str],
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """a's sidecar, started by hand as the docs show."""
    side = start_sidecar(dyn, replicas[0], tmp_path_factory.mktemp("logs") / "sidecar-a.log")
    yield side
    side.kill()


@pytest.fixture(scope="module")
def sidecars(replicas: list[ServerProcess], hand_sidecar: ServerProcess) -> list[str]:
    """The system URLs of a's sidecar and of b's, which b runs itself (``tito serve --dynamo-namespace``)."""
    own = child_system_url(replicas[1])
    wait_for(lambda: _status(own + "/health") == 200, 180, "b's own sidecar to be ready")
    return [hand_sidecar.url, own]


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


@pytest.fixture(scope="module")
def frontend(dyn: dict[str, str], sidecars: list[str],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    fe, rl_url = start_frontend(dyn, tmp_path_factory.mktemp("logs") / "frontend.log")
    try:
        wait_for(lambda: MODEL in models_listed(fe), 120, "the model in the frontend's /v1/models")
        wait_for(lambda: len(rl_workers(rl_url)) == 2, 120, "both replicas in /v1/rl/workers")
        yield fe, rl_url
    finally:
        fe.kill()


@pytest.fixture(scope="module")
def fe(frontend: tuple[ServerProcess, str]) -> ServerProcess:
    return frontend[0]


def _tokenizer(r: ServerProcess) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir(r)))


def _tito_greedy(r: ServerProcess, ids: list[int], n: int, **body: Any) -> list[int]:
    resp = httpx.post(r.url + GEN, timeout=120, json={"token_ids": ids, **body, "sampling_params": {
        "max_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert resp.status_code == 200, resp.text
    return list(resp.json()["choices"][0]["token_ids"])


def _post(fe: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(fe.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _sse(fe: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    with httpx.stream("POST", fe.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


# ------------------------------------------------------------------------------------------------ serving


def test_completions_chat_and_generate_answer_with_titos_greedy_tokens(fe: ServerProcess,
                                                                       replicas: list[ServerProcess]) -> None:
    a = replicas[0]
    tok = _tokenizer(a)
    prompt = "Tell me about the sea"
    ids = tok.encode(prompt, add_special_tokens=True)
    # Special tokens are left out of the text (skip_special_tokens, on by default), as vLLM does.
    want = tok.decode(_tito_greedy(a, ids, 12), skip_special_tokens=True)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    out = _post(fe, "/v1/completions", body)
    assert (out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]) == (len(ids), 12)
    assert out["choices"][0]["text"] == want.removesuffix("\ufffd")
    assert "".join(c["choices"][0]["text"] for c in _sse(fe, "/v1/completions", body) if c.get("choices")) == \
        out["choices"][0]["text"]

    messages = [{"role": "user", "content": "Tell me a story about the sea."}]
    chat_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    want = tok.decode(_tito_greedy(a, chat_ids, 10), skip_special_tokens=True).removesuffix("\ufffd")
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    out = _post(fe, "/v1/chat/completions", body)
    assert out["usage"]["prompt_tokens"] == len(chat_ids)  # the frontend applied the model's chat template
    assert out["choices"][0]["message"]["content"] == want
    chunks = _sse(fe, "/v1/chat/completions", body)
    assert "".join((c["choices"][0].get("delta") or {}).get("content") or "" for c in chunks if c.get("choices")) \
        == want

    for p in PROMPTS:  # Dynamo's token route: the same greedy tokens as tito's own token API
        out = _post(fe, GEN, {"model": MODEL, "token_ids": p, "sampling_params": {
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}})
        assert out["choices"][0]["token_ids"] == _tito_greedy(a, p, 12)


@pytest.mark.parametrize("prompt", [[7] * 600, [5, 100000, 6]], ids=["too long", "out of vocabulary"])
def test_bad_input_is_a_4xx_and_both_replicas_keep_serving(fe: ServerProcess, replicas: list[ServerProcess],
                                                           prompt: list[int]) -> None:
    r = httpx.post(fe.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4}, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    _post(fe, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})
    for s in replicas:
        assert httpx.get(s.url + "/ready", timeout=10).status_code == 200


# ------------------------------------------------------------------------------------------------ KV routing


def _counters(s: ServerProcess) -> tuple[float, float]:
    """(requests finished, prefix-cache hit tokens) of one replica's engine."""
    text = httpx.get(s.url + "/metrics", timeout=30).text
    return (metric_value(text, "vllm:request_success_total") or 0.0,
            metric_value(text, "vllm:prefix_cache_hits_total") or 0.0)


def _stored_events_applied(fe: ServerProcess) -> float:
    """KV "stored" events the frontend's KV router has applied to its index, over every worker."""
    text = httpx.get(fe.url + "/metrics", timeout=30).text
    return metric_value(text, "dynamo_component_kv_cache_events_applied", {"event_type": "stored", "status": "ok"}) \
        or 0.0


def test_kv_router_sends_a_prefix_to_the_replica_that_cached_it(fe: ServerProcess,
                                                               replicas: list[ServerProcess]) -> None:
    """Ten prompts of five KV blocks, each in two versions (same head, another ending). The first version of prompt
    i is cached on replica i % 2 directly (tito's own API: the engine publishes its KV events whoever asked); once
    the events have travelled (engine → ZMQ → the sidecar → Dynamo's event plane → the router), the second version,
    sent to the frontend, must go where its head is cached."""
    rng = random.Random(1)
    pairs = []
    for _ in range(10):
        head = [rng.randrange(5, 500) for _ in range(5 * BLOCK)]
        pairs.append([head + [rng.randrange(5, 500) for _ in range(8)] for _ in range(2)])
    applied = _stored_events_applied(fe)
    for i, (first, _) in enumerate(pairs):
        _tito_greedy(replicas[i % 2], first, 1)
    # Each first version stored its blocks in one event at least: wait until the router's index has applied ten more.
    wait_for(lambda: _stored_events_applied(fe) >= applied + 10, 60, "the KV events at the frontend's router")
    served, hits = [], []
    for _, second in pairs:
        before = [_counters(s) for s in replicas]
        _post(fe, "/v1/completions", {"model": MODEL, "prompt": second, "max_tokens": 1})
        after = [_counters(s) for s in replicas]
        moved = [k for k in range(2) if after[k][0] > before[k][0]]
        assert len(moved) == 1, (before, after)
        served.append(moved[0])
        hits.append(after[moved[0]][1] - before[moved[0]][1])
    same = sum(served[i] == i % 2 for i in range(10))
    print(f"kv router: {same}/10 second versions on the replica that cached the head; prefix hit tokens {hits}")
    assert same >= 9
    assert sum(h >= 5 * BLOCK for h in hits) >= 9


# ------------------------------------------------------------------------------------------------ cancellation


def _busy(s: ServerProcess) -> tuple[int, float]:
    """(tito's generate requests in flight, the engine's running + waiting requests)."""
    text = httpx.get(s.url + "/metrics", timeout=10).text
    engine = (metric_value(text, "vllm:num_requests_running") or 0.0) + (
        metric_value(text, "vllm:num_requests_waiting") or 0.0)
    return int(httpx.get(s.url + "/health", timeout=10).json()["inflight"]), engine


@TIMING
def test_a_client_leaving_the_frontend_frees_the_engine_within_2s(fe: ServerProcess,
                                                                  replicas: list[ServerProcess]) -> None:
    """The request is frozen in its replica's engine (``/pause?mode=keep``) before the client leaves: from then on
    only an abort takes it out, so the time until it is gone is the cancellation's path (client → frontend →
    sidecar resets its gRPC stream and calls Control.Abort → tito aborts it in the engine)."""

    async def run() -> float:
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": MODEL, "prompt": [9, 8, 7, 6], "max_tokens": 480, "ignore_eos": True, "stream": True}

            async def client() -> None:
                async with c.stream("POST", fe.url + "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass

            task = asyncio.ensure_future(client())
            holder = None
            deadline = time.monotonic() + 60
            while holder is None and time.monotonic() < deadline and not task.done():
                for s in replicas:
                    if (await asyncio.to_thread(_busy, s))[0]:
                        holder = s
                        break
                await asyncio.sleep(0.01)
            assert holder is not None, "the request never reached a replica"
            assert (await c.post(holder.url + "/pause", params={"mode": "keep"})).status_code == 200
            try:
                assert await asyncio.to_thread(_busy, holder) == (1, 1.0), "finished before the freeze: retried"
                task.cancel()  # the client leaves
                await asyncio.gather(task, return_exceptions=True)
                t0 = time.monotonic()
                await asyncio.to_thread(wait_for, lambda: _busy(holder) == (0, 0.0), 30,
                                        "the engine to drop the request", 0.05)
                return time.monotonic() - t0
            finally:
                await c.post(holder.url + "/resume")

    took = asyncio.run(run())
    print(f"client left the frontend: request gone from tito and its engine after {took:.3f}s")
    assert took <= 2.0


# ------------------------------------------------------------------------------------------------ engine control


def _engine(side: str, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    r = httpx.post(f"{side}/engine/{route}", json=body or {}, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize("i", [0, 1], ids=["sidecar started by hand", "sidecar started by tito"])
def test_engine_control_through_the_sidecars_system_port(sidecars: list[str], fe: ServerProcess,
                                                         replicas: list[ServerProcess], i: int) -> None:
    side, a = sidecars[i], replicas[i]
    try:
        assert _engine(side, "control/pause_generation", {"mode": "keep"}) == {"status": "paused"}
        assert httpx.get(a.url + "/is_paused").json() == {"is_paused": True}
        assert _engine(side, "control/is_paused") == {"is_paused": True}
    finally:
        assert _engine(side, "control/resume_generation") == {"status": "resumed"}
    assert httpx.get(a.url + "/is_paused").json() == {"is_paused": False}
    assert _engine(side, "control/is_paused") == {"is_paused": False}
    recent = [c["call"] for c in httpx.get(a.url + "/server_info").json()["state"]["control"]["recent"]]
    assert recent[-2:] == ["pause (mode=keep)", "resume"]
    try:
        assert _engine(side, "update/update_weight_version", {"new_version": "v-side"}) == \
            {"success": True, "new_version": "v-side"}
        assert _engine(side, "control/get_weight_version") == {"weight_version": "v-side"}
        assert httpx.get(a.url + "/server_info").json()["state"]["weight_version"] == "v-side"
    finally:
        _engine(side, "update/update_weight_version", {"new_version": "default"})
    assert _engine(side, "control/is_sleeping") == {"is_sleeping": False}


def test_lora_load_request_by_adapter_name_and_unload_through_the_sidecars(
        sidecars: list[str], fe: ServerProcess, replicas: list[ServerProcess],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """As an RL trainer does it, on every replica (Dynamo 1.6.1's frontend may send an adapter's request to any worker
    of the component, not only to those that loaded it): load through each sidecar's system port, request by the
    adapter's name through the frontend, unload."""
    from tests.test_lora import make_weights, write_adapter

    base = load_file(str(model_dir(replicas[0]) / "model.safetensors"))
    path = write_adapter(tmp_path_factory.mktemp("sidecar-serve-lora") / "ad", make_weights(base, 3))
    try:
        for side in sidecars:
            out = _engine(side, "update/load_lora", {"lora_name": "ad", "source": {"uri": f"file://{path}"}})
            assert out["status"] == "success" and out["lora_id"] > 0, out
        for r in replicas:
            assert "ad" in {m["id"] for m in httpx.get(r.url + "/v1/models").json()["data"]}
        wait_for(lambda: "ad" in models_listed(fe), 60, "the adapter in the frontend's /v1/models")
        for p in PROMPTS:
            want = _tito_greedy(replicas[0], p, 8, model="ad")
            assert want == _tito_greedy(replicas[1], p, 8, model="ad") != _tito_greedy(replicas[0], p, 8)
            for _ in range(2):
                got = _post(fe, GEN, {"model": "ad", "token_ids": p, "sampling_params": {
                    "max_tokens": 8, "temperature": 0, "ignore_eos": True}})["choices"][0]["token_ids"]
                assert got == want
    finally:
        outs = [_engine(side, "update/unload_lora", {"lora_name": "ad"}) for side in sidecars]
    assert all(o["status"] == "success" for o in outs), outs
    for r in replicas:
        assert "ad" not in {m["id"] for m in httpx.get(r.url + "/v1/models").json()["data"]}
    wait_for(lambda: "ad" not in models_listed(fe), 60, "the adapter gone from the frontend")


# ------------------------------------------------------------------------------------------------ RL


def test_trainer_finds_the_replicas_through_dynamo_and_updates_weights_three_times(
        frontend: tuple[ServerProcess, str], replicas: list[ServerProcess], hand_sidecar: ServerProcess,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The seed run: a trainer loop that knows only the frontend. It lists the workers (stable over two polls, world
    sizes summing to its inference world size, as Prime-RL requires), then per step posts Prime-RL's admin calls to
    every admin_base_url (pause keep, /update_weights, resume), generates through the frontend, and checks the
    tokens against transformers on the step's weights; no process restarts."""
    from tests.rl_steps import reference_greedy, write_step

    fe, rl_url = frontend
    first, second = rl_workers(rl_url), rl_workers(rl_url)
    assert {w["instance_id"] for w in first} == {w["instance_id"] for w in second}
    admins = sorted(w["admin_base_url"].rstrip("/") for w in first)
    assert admins == sorted(r.url for r in replicas)
    for w in first:
        info = httpx.get(w["admin_base_url"].rstrip("/") + "/server_info", timeout=30).json()
        assert w["world_size"] == info["parallelism"]["world_size"] == 1 and w["model"] == MODEL
        assert not w.get("error")
    assert sum(w["world_size"] for w in first) == 2  # the trainer's inference world size
    # Both sidecars (one by hand, one by tito) in one component: one worker set, one KV router for the model.
    assert {w["component"] for w in first} == {"backend"}
    pids = [httpx.get(u + "/server_info").json()["server"]["pid"] for u in admins]

    root = tmp_path_factory.mktemp("sidecar-steps")
    for step, seed in ((1, 101), (2, 202), (3, 303)):
        sd = tiny_state_dict(seed)
        d = write_step(root / f"step_{step}", sd)
        for url in admins:
            with httpx.Client(base_url=url, timeout=300) as admin:
                assert admin.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
                try:
                    r = admin.post("/update_weights", json={"weight_dir": str(d)})
                    assert r.status_code == 200 and r.json()["weight_version"] == f"step_{step}", r.text
                finally:
                    assert admin.post("/resume").status_code == 200
        want = reference_greedy(sd, root / f"ref-{step}", PROMPTS, 8)
        for _ in range(2):  # the router may pick either replica: both must be on the new weights
            got = [_post(fe, GEN, {"model": MODEL, "token_ids": p, "sampling_params": {
                "max_tokens": 8, "temperature": 0}})["choices"][0]["token_ids"] for p in PROMPTS]
            assert got == want, f"step {step}"
        for url in admins:
            assert httpx.get(url + "/weight_info").json() == {"weight_version": f"step_{step}"}
    assert [httpx.get(u + "/server_info").json()["server"]["pid"] for u in admins] == pids
    assert all(s.proc is not None and s.proc.poll() is None for s in (*replicas, hand_sidecar, fe))
    for r in replicas:  # the base weights again, for the tests after this one
        assert httpx.post(r.url + "/reload_weights", timeout=300).status_code == 200


# ------------------------------------------------------------------------------------------------ leaving


class Load:
    """Sequential completions through the frontend from a thread, counting failures, until stopped."""

    def __init__(self, fe: ServerProcess) -> None:
        self.fe, self.ok = fe, 0
        self.failed: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self._stop.is_set():
                try:
                    r = c.post(self.fe.url + "/v1/completions",
                               json={"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True})
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failed.append((r.status_code, r.text[:300]))
                except httpx.HTTPError as e:
                    self.failed.append((0, repr(e)))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def more(self, n: int, what: str) -> None:
        start = self.ok
        wait_for(lambda: self.ok >= start + n, 60, what)


def test_drain_one_replica_and_shut_the_other_down_under_load_with_no_failed_request(
        fe: ServerProcess, frontend: tuple[ServerProcess, str], replicas: list[ServerProcess],
        sidecars: list[str]) -> None:
    """A draining or stopping replica refuses new work with UNAVAILABLE; the frontend migrates such a request to
    the other replica (``--migration-limit``), and in-flight ones finish where they are. b shuts down through
    ``vllm.Control/Shutdown`` (tito's SIGTERM drain) and stops its own sidecar on the way out."""
    a, b = replicas
    with Load(fe) as load:
        load.more(5, "traffic through the frontend")
        assert httpx.post(a.url + "/drain", json={"timeout": 5}, timeout=30).status_code == 200
        try:
            load.more(20, "traffic served while a drains")
        finally:
            assert httpx.delete(a.url + "/drain", timeout=30).status_code == 200
        # The frontend keeps a worker that refused a request aside for a few seconds: b goes only once a serves
        # again ("while one serves").
        served = _counters(a)[0]
        wait_for(lambda: _counters(a)[0] >= served + 5, 60, "a to serve again after its drain")
        control(b).Shutdown(cpb.ShutdownRequest())  # tito's SIGTERM drain, asked over gRPC
        assert b.proc is not None and b.proc.wait(120) == 0
        assert _status(sidecars[1] + "/health") == 0  # b's own sidecar went with it
        wait_for(lambda: len(rl_workers(frontend[1])) == 1, 60, "b to leave discovery")
        load.more(20, "traffic served by a alone")
    print(f"{load.ok} requests through the frontend while a replica drained and another shut down; "
          f"{len(load.failed)} failed")
    assert load.failed == [], load.failed
