"""Scale out behind Dynamo: Dynamo's own frontend (ai-dynamo 1.6.1, file discovery, no etcd/NATS) serves OpenAI
completions and chat through two real tito replicas, with KV-aware routing from the engines' KV-cache events.

Two replicas (the tiny model with its tokenizer, 32-token KV blocks, KV events on) and two frontends over the same
discovery directory (``--router-mode kv`` and ``round-robin``) are shared by every test here. The replica-stopping
test runs last.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.dynamo.adapter import dynamo_available
from tests.helpers import TIMING, ServerProcess, engine_env, free_port, metric_value, tito_cmd
from tests.test_dynamo import wait_for  # the same polling helper

pytestmark = pytest.mark.skipif(not dynamo_available(), reason="the `dynamo` extra (ai-dynamo-runtime) is not "
                                "installed; `make test` installs it")

NS = "titoserve"
BLOCK = 32
MODEL = "tiny"


@pytest.fixture(scope="module")
def dyn_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    kv = tmp_path_factory.mktemp("dynamo_kv")
    # VLLM_HOST_IP: the engines' KV-event publishers (--kv-events-port 0) bind free ports on loopback.
    return {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(kv), "DYN_NAMESPACE": NS, "DYN_LOG": "warn",
            "VLLM_HOST_IP": "127.0.0.1"}


def _frontend(dyn_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, mode: str) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "dynamo.frontend", "--http-port", str(port), "--discovery-backend", "file",
           "--router-mode", mode, "--migration-limit", "3"]
    log = tmp_path_factory.mktemp("logs") / f"frontend-{mode}.log"
    return ServerProcess(cmd, port, log, env=engine_env(dyn_env), health_path="/live").start(timeout=120)


@pytest.fixture(scope="module")
def replicas(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
             dyn_env: dict[str, str]) -> Iterator[list[ServerProcess]]:
    args = ("--served-model-name", MODEL, "--dynamo-namespace", NS, "--block-size", str(BLOCK),
            "--kv-events-port", "0", "--max-num-seqs", "16")
    # Started side by side: two engine starts overlap instead of adding up.
    def start(i: int) -> ServerProcess:
        log = tmp_path_factory.mktemp("logs") / f"replica-{i}.log"
        port = free_port()
        server = ServerProcess(tito_cmd(tiny_model, port, *args), port, log, env=engine_env(dyn_env))
        try:
            return server.start(timeout=1200)  # two engines starting at once on a busy 2-core machine
        except RuntimeError:
            server.kill()
            raise

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, i) for i in range(2)]
    servers = [f.result() for f in futures if f.exception() is None]
    if len(servers) < 2:
        for srv in servers:
            srv.kill()
        raise next(e for f in futures if (e := f.exception()) is not None)
    yield servers
    for s in servers:
        s.kill()


@pytest.fixture(scope="module")
def kv_frontend(dyn_env, tmp_path_factory, replicas) -> Iterator[ServerProcess]:
    fe = _frontend(dyn_env, tmp_path_factory, "kv")
    wait_for(lambda: len(generate_instances(dyn_env)) == 2, 120, "both replicas' generate in discovery")
    wait_for(lambda: _model_listed(fe), 120, "the model in the frontend's /v1/models")
    yield fe
    fe.kill()


def _model_listed(fe: ServerProcess) -> bool:
    return any(m["id"] == MODEL for m in httpx.get(fe.url + "/v1/models", timeout=10).json().get("data", []))


def generate_instances(dyn_env: dict[str, str]) -> list[str]:
    d = Path(dyn_env["DYN_FILE_KV"]) / "v1" / "instances"
    return sorted(p.name for p in d.iterdir() if "generate" in p.name) if d.is_dir() else []


def metrics(server: ServerProcess) -> str:
    return httpx.get(server.url + "/metrics", timeout=30).text


def counters(server: ServerProcess) -> tuple[float, float]:
    """(requests finished, prefix-cache hit tokens) of one replica's engine."""
    text = metrics(server)
    return (metric_value(text, "vllm:request_success_total") or 0.0,
            metric_value(text, "vllm:prefix_cache_hits_total") or 0.0)


def tito_generate(server: ServerProcess, ids: list[int], n: int, logprobs: int | None = None) -> dict[str, Any]:
    sp: dict[str, Any] = {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}
    if logprobs is not None:
        sp["logprobs"] = logprobs
    r = httpx.post(server.url + "/inference/v1/generate", json={"token_ids": ids, "sampling_params": sp}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def sse(fe: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    with httpx.stream("POST", fe.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


# ------------------------------------------------------------------------------------------------ serving


def test_card_and_server_info(kv_frontend, replicas, dyn_env):
    info = httpx.get(replicas[0].url + "/server_info", timeout=30).json()
    model = info["model"]
    assert model["kv_block_size"] == BLOCK and model["num_kv_blocks"] > 0 and model["has_tokenizer"] is True
    assert list(info["features"]["kv_events"]) == ["0"]
    assert info["features"]["kv_events"]["0"].startswith("tcp://127.0.0.1:")
    cards = [json.loads(p.read_text()) for p in (Path(dyn_env["DYN_FILE_KV"]) / "v1" / "mdc").iterdir()]
    assert len(cards) == 2
    for c in cards:
        card = c["card_json"]
        assert card["model_type"] == "Chat | Completions" and card["model_input"] == "Tokens"
        assert card["kv_cache_block_size"] == BLOCK
        assert card["runtime_config"]["total_kv_blocks"] == model["num_kv_blocks"]
        assert card["runtime_config"]["context_length"] == model["max_model_len"] == 512


def test_completions_equal_titos_greedy_json_and_sse(kv_frontend, replicas):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(replicas[0].cmd[replicas[0].cmd.index("--model") + 1]))
    prompt = [17, 250, 33, 401, 9, 77, 300, 5]
    direct = tito_generate(replicas[0], prompt, 12, logprobs=1)
    want = tok.decode(direct["token_ids"])
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "logprobs": 1,
            "ignore_eos": True}
    r = httpx.post(kv_frontend.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == want
    assert r.json()["usage"]["completion_tokens"] == 12 and r.json()["usage"]["prompt_tokens"] == len(prompt)
    lps = choice["logprobs"]["token_logprobs"]
    assert lps == pytest.approx([e["logprob"] for e in direct["logprobs"]["content"]], abs=1e-4)
    chunks = sse(kv_frontend, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == want


def test_chat_json_and_sse_through_tito(kv_frontend, replicas):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(replicas[0].cmd[replicas[0].cmd.index("--model") + 1]))
    messages = [{"role": "user", "content": "Tell me a story about the sea."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    direct = tito_generate(replicas[1], ids, 10)
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(kv_frontend.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["prompt_tokens"] == len(ids)  # the frontend applied the same chat template
    assert out["choices"][0]["message"]["content"] == tok.decode(direct["token_ids"], skip_special_tokens=True)
    chunks = sse(kv_frontend, "/v1/chat/completions", body)
    text = "".join((c["choices"][0].get("delta") or {}).get("content") or "" for c in chunks if c.get("choices"))
    assert text == out["choices"][0]["message"]["content"]


@pytest.mark.parametrize("prompt", [[7] * 600, [5, 100000, 6]], ids=["too long", "out of vocabulary"])
def test_bad_input_is_a_4xx_and_replicas_keep_serving(kv_frontend, replicas, prompt):
    r = httpx.post(kv_frontend.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
                   timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    ok = httpx.post(kv_frontend.url + "/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    for s in replicas:
        assert httpx.get(s.url + "/ready", timeout=10).status_code == 200


def _busy(server: ServerProcess) -> tuple[int, float]:
    """(tito's generate requests in flight, the engine's running + waiting requests)."""
    text = metrics(server)
    engine = (metric_value(text, "vllm:num_requests_running") or 0.0) + (
        metric_value(text, "vllm:num_requests_waiting") or 0.0)
    return int(httpx.get(server.url + "/health", timeout=10).json()["inflight"]), engine


@TIMING
def test_client_leaving_the_frontend_aborts_in_tito(kv_frontend, replicas):
    """The request is frozen in its replica's engine (``/pause?mode=keep``, as soon as tito has it) before the client
    leaves: from then on only an abort can take it out, and the time until it is gone is the cancellation's path
    (client → frontend → Dynamo context → adapter closes its stream → tito aborts in the engine)."""

    async def run() -> tuple[float, ServerProcess]:
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": MODEL, "prompt": [9, 8, 7, 6], "max_tokens": 500, "ignore_eos": True, "stream": True}

            async def client() -> None:
                async with c.stream("POST", kv_frontend.url + "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass

            task = asyncio.ensure_future(client())
            deadline = time.monotonic() + 60
            holder: ServerProcess | None = None
            while holder is None and time.monotonic() < deadline and not task.done():
                for s in replicas:
                    if (await asyncio.to_thread(_busy, s))[0]:
                        holder = s
                        break
                await asyncio.sleep(0.01)
            assert holder is not None, "the request never reached a replica"
            assert (await c.post(holder.url + "/pause", params={"mode": "keep"})).status_code == 200
            try:
                inflight, engine = await asyncio.to_thread(_busy, holder)
                assert inflight == 1 and engine == 1, "finished before the freeze: retried"  # frozen in flight
                task.cancel()  # the client leaves
                await asyncio.gather(task, return_exceptions=True)
                t0 = time.monotonic()
                await asyncio.to_thread(wait_for, lambda: _busy(holder) == (0, 0.0), 30,
                                        "the engine to drop the request", 0.05)
                return time.monotonic() - t0, holder
            finally:
                await c.post(holder.url + "/resume")

    took, holder = asyncio.run(run())
    print(f"client left the frontend: request gone from tito and its engine after {took:.3f}s")
    assert took <= 2.0
    assert "cancelled by the frontend" in holder.log_text()


# ------------------------------------------------------------------------------------------------ KV-aware routing


def _pairs(seed: int) -> list[tuple[list[int], list[int]]]:
    """Ten prompts of five KV blocks each, each with two different endings."""
    rng = random.Random(seed)
    out = []
    for _ in range(10):
        head = [rng.randrange(5, 500) for _ in range(5 * BLOCK)]
        out.append((head + [rng.randrange(5, 500) for _ in range(8)], head + [rng.randrange(5, 500) for _ in range(8)]))
    return out


def _affinity(fe: ServerProcess, replicas: list[ServerProcess], seed: int) -> tuple[int, list[float]]:
    """Send each prompt's two versions (the second one request later, so the first one's KV events have been
    published), and count the second versions served by the replica that served the first; also return the
    prefix-cache hit tokens each second version got there."""
    pairs = _pairs(seed)
    order: list[tuple[int, int]] = [(0, 0), (1, 0)]
    for i in range(2, 10):
        order += [(i, 0), (i - 2, 1)]
    order += [(8, 1), (9, 1)]
    served: dict[tuple[int, int], int] = {}
    hits: dict[tuple[int, int], float] = {}
    before = [counters(s) for s in replicas]
    for i, version in order:
        r = httpx.post(fe.url + "/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": pairs[i][version], "max_tokens": 1})
        assert r.status_code == 200, r.text
        after = [counters(s) for s in replicas]
        moved = [k for k in range(2) if after[k][0] > before[k][0]]
        assert len(moved) == 1, (before, after)
        served[(i, version)] = moved[0]
        hits[(i, version)] = after[moved[0]][1] - before[moved[0]][1]
        before = after
    same = sum(served[(i, 0)] == served[(i, 1)] for i in range(10))
    return same, [hits[(i, 1)] for i in range(10)]


def test_kv_router_sends_a_prefix_to_the_replica_that_cached_it(kv_frontend, replicas):
    same, hits = _affinity(kv_frontend, replicas, seed=1)
    print(f"kv router: {same}/10 second versions on the first version's replica; prefix hit tokens {hits}")
    assert same >= 9
    assert sum(h >= BLOCK for h in hits) >= 9


def test_round_robin_shows_no_such_affinity(kv_frontend, replicas, dyn_env, tmp_path_factory):
    rr = _frontend(dyn_env, tmp_path_factory, "round-robin")
    try:
        wait_for(lambda: _model_listed(rr), 120, "the model in the round-robin frontend")
        same, hits = _affinity(rr, replicas, seed=2)
    finally:
        rr.kill()
    print(f"round-robin: {same}/10 second versions on the first version's replica; prefix hit tokens {hits}")
    assert same < 9


# ------------------------------------------------------------------------------------------------ leaving


class Load:
    """Sequential completions through the frontend from a thread, counting failures, until stopped."""

    def __init__(self, fe: ServerProcess) -> None:
        self.fe, self.ok, self.failed = fe, 0, []  # type: ignore[var-annotated]
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


def test_drain_and_shutdown_leave_discovery_with_no_failed_requests(kv_frontend, replicas, dyn_env):
    a, b = replicas
    with Load(kv_frontend) as load:
        wait_for(lambda: load.ok >= 3, 60, "traffic through the frontend")
        try:
            assert httpx.post(a.url + "/drain", json={"timeout": 5}, timeout=30).status_code == 200
            wait_for(lambda: len(generate_instances(dyn_env)) == 1, 30, "the draining replica to leave discovery")
            n = load.ok
            wait_for(lambda: load.ok >= n + 5, 60, "traffic served by the other replica")
        finally:
            httpx.delete(a.url + "/drain", timeout=30)
        wait_for(lambda: len(generate_instances(dyn_env)) == 2, 30, "the undrained replica back in discovery")
        b.signal(signal.SIGTERM)  # shutdown: the adapter unregisters, the other replica takes the traffic
        wait_for(lambda: len(generate_instances(dyn_env)) == 1, 60, "the stopped replica to leave discovery")
        n = load.ok
        wait_for(lambda: load.ok >= n + 5, 60, "traffic served by the remaining replica")
    assert load.failed == [], load.failed
    print(f"{load.ok} requests through the frontend while a replica drained and another shut down; 0 failed")
