"""Several API processes, one server (``tito serve --api-server-count N``; app/server/api_processes.py), on real
engines: the shared ``api2`` (Prime-RL's launcher's own command line for data parallel 2, from which Prime-RL's
config sets ``--api-server-count 2``; tests/conftest.py) and, for the deaths, a server of this module's own.

Each test reaches a chosen API process through its private Unix socket (``/server_info`` lists them): the calls that
change the server go through one process while requests run through another, and every process must then answer
the same. The last test ends ``api2`` with SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from app.client.commands import format_status
from tests.conftest import module_server, start_tito
from tests.helpers import ServerProcess, metric_value, restore_server
from tests.prime_rl_src import PRIME_MODEL, prime_rl_update
from tests.reference import PeftReference
from tests.rl_steps import write_step
from tests.streaming import family, read_stream, stream_body, wait_gone
from tests.test_lora import make_weights, write_adapter
from tests.test_lora_exactness import _prompt, _prompt_lps, _worst

pytestmark = pytest.mark.engine

GEN = "/inference/v1/generate"
TOL = 1e-4


@pytest.fixture(scope="module")
def server(api2: ServerProcess) -> Iterator[ServerProcess]:
    yield api2
    if api2.proc is not None and api2.proc.poll() is None:
        restore_server(api2.url)


def sockets(server: ServerProcess) -> list[str]:
    """The API processes' private sockets, in index order."""
    return [r["socket"] for r in _rows(server) if r["role"] == "api"]


def via(path: str, timeout: float = 120.0) -> httpx.Client:
    """A client of one API process (its private socket: the same app as the port)."""
    return httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://tito", timeout=timeout)


def avia(path: str, timeout: float = 300.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), base_url="http://tito", timeout=timeout,
                             limits=httpx.Limits(max_connections=64))


@pytest.fixture(scope="module")
def procs(server: ServerProcess) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    paths = sockets(server)
    assert len(paths) == 2
    with via(paths[0]) as a, via(paths[1]) as b:
        yield a, b


def _forwarded(server: ServerProcess) -> list[int]:
    rows = httpx.get(server.url + "/server_info", timeout=30).json()["api_processes"]
    return [r["forwarded"] for r in rows if r["role"] == "api"]


def _same_everywhere(a: httpx.Client, b: httpx.Client, path: str) -> Any:
    ra, rb = a.get(path), b.get(path)
    assert (ra.status_code, ra.json()) == (rb.status_code, rb.json()), (path, ra.text, rb.text)
    return ra.json()


def test_prime_rl_launcher_with_dp2_starts_two_api_processes(server: ServerProcess, procs: Any) -> None:
    """Prime-RL's own arguments for dp = 2 carry ``--api-server-count 2``, and tito takes them as they are: two API
    processes on the port, a control process, two engine cores; every process answers the same."""
    argv = server.launch_argv  # type: ignore[attr-defined]
    assert argv[argv.index("--api-server-count") + 1] == "2" and argv[argv.index("--data-parallel-size") + 1] == "2"
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    assert info["parallelism"]["api_server_count"] == 2 and info["parallelism"]["data_parallel_size"] == 2
    rows = info["api_processes"]
    assert [r["role"] for r in rows] == ["api", "api", "control"] and all(r["alive"] and r["up"] for r in rows)
    assert rows[2]["pid"] == server.proc.pid == info["server"]["pid"]  # type: ignore[union-attr]
    children = {p.pid: p for p in psutil.Process(server.proc.pid).children()}  # type: ignore[union-attr]
    assert {rows[0]["pid"], rows[1]["pid"]} <= set(children)
    assert sum("EngineCore" in p.name() for p in family(server.proc.pid)) == 2  # type: ignore[union-attr]
    a, b = procs
    for path in ("/health", "/is_paused", "/v1/models", "/ready", "/version"):
        _same_everywhere(a, b, path)
    assert [m["id"] for m in a.get("/v1/models").json()["data"]] == [PRIME_MODEL]
    sa, sb = a.get("/server_info").json(), b.get("/server_info").json()  # the control process answers both
    assert sa["server"]["pid"] == sb["server"]["pid"] == rows[2]["pid"]
    status = format_status(info)  # `tito status`
    assert "parallelism     dp=2 tp=1 api=2" in status and f"api 1 pid {rows[1]['pid']}: " in status
    assert f"control pid {rows[2]['pid']}: " in status


def test_control_calls_through_either_process_hold_for_the_whole_server(server: ServerProcess, procs: Any) -> None:
    """A pause through one process is what the other answers, and what its requests wait for; a resume through the
    other ends it for both. Each call is passed to the control process: the forwarded counts say so."""
    a, b = procs
    before = _forwarded(server)
    assert a.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    try:
        assert b.get("/is_paused").json() == {"is_paused": True} == a.get("/is_paused").json()

        async def held() -> dict[str, Any]:
            async with avia(sockets(server)[1]) as c:
                return dict((await c.post(GEN, json={"token_ids": [3, 1, 4], "sampling_params": {
                    "max_tokens": 4, "temperature": 0}})).json())

        async def run() -> dict[str, Any]:
            task = asyncio.ensure_future(held())
            await asyncio.sleep(0.5)
            assert not task.done(), "a request through the other process ran while the server was paused"
            r = b.post("/resume")
            assert r.json() == {"status": "resumed"}, r.text
            return await asyncio.wait_for(task, 60)

        answer = asyncio.run(run())
        assert len(answer["choices"][0]["token_ids"]) == 4
    finally:
        b.post("/resume")
    assert a.get("/is_paused").json() == {"is_paused": False} == b.get("/is_paused").json()
    after = _forwarded(server)
    assert after[0] >= before[0] + 1 and after[1] >= before[1] + 1


def _step_weights(model_dir: Path, out: Path) -> Path:
    """A trainer's next step: the model's weights moved a little (a different greedy answer)."""
    sd = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    sd = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v for k, v in sd.items()}
    return write_step(out, sd)


def _versions(spans: list[dict[str, Any]] | None) -> list[str]:
    return [s["version"] for s in spans or []]


def test_prime_rl_update_through_the_port_while_both_processes_stream_and_admit(
        server: ServerProcess, procs: Any, tmp_path: Path) -> None:
    """Prime-RL's admin client pauses (keep), updates and resumes through the port while rollouts stream through
    both API processes and one of them keeps admitting requests: every rollout carries the version it was generated
    with (the frozen ones: the old weights' tokens, then the new), every request admitted once the update answered
    is on the new weights, and both processes then answer the same prompt logprobs, the new weights' (the tied random
    model's greedy tokens are its last input token over and over, whatever the weights)."""
    a, b = procs
    model_dir = Path(a.get("/server_info").json()["model"]["path"])
    step_dir = _step_weights(model_dir, tmp_path / "step_1")
    probe = {"token_ids": [3, 1, 4, 1, 5], "sampling_params": {"max_tokens": 1, "prompt_logprobs": 1}}

    def logprobs(c: httpx.Client) -> tuple[list[float], list[str]]:
        answer = c.post(GEN, json=probe).json()
        return _prompt_lps(answer, probe["token_ids"]), _versions(answer["choices"][0]["weight_versions"])

    old, _ = logprobs(a)
    paths = sockets(server)

    async def run() -> tuple[list[dict[str, Any]], list[tuple[float, dict[str, Any]]], float]:
        async with avia(paths[0]) as ca, avia(paths[1]) as cb:
            firsts = [asyncio.Event() for _ in range(6)]
            streams = [asyncio.ensure_future(read_stream(c, stream_body(400, seed=i), first=firsts[i]))
                       for i, c in enumerate((ca, cb) * 3)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 120)
            # Frozen where they are (the previous step's pause), so that Prime-RL's step lands mid-rollout.
            assert (await cb.post("/pause", params={"mode": "keep", "clear_cache": "false"})).status_code == 200
            admitted: list[tuple[float, dict[str, Any]]] = []
            stop = asyncio.Event()

            async def admit() -> None:  # process B keeps taking requests through the whole update
                while not stop.is_set():
                    r = await cb.post(GEN, json={"token_ids": [7, 8, 9], "sampling_params": {"max_tokens": 3,
                                                                                             "temperature": 0}})
                    assert r.status_code == 200, r.text
                    admitted.append((time.monotonic(), r.json()["choices"][0]))

            admitting = [asyncio.ensure_future(admit()) for _ in range(2)]
            await asyncio.sleep(0.2)
            await prime_rl_update(server.url, step_dir, 1)
            answered = time.monotonic()
            await asyncio.sleep(0.3)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*admitting), 120)
            return await asyncio.wait_for(asyncio.gather(*streams), 300), admitted, answered

    streams, admitted, answered = asyncio.run(run())
    for s in streams:
        assert s["status"] == 200 and not s["errors"] and len(s["tokens"]) == 400, s
        assert _versions(s["spans"]) == ["default", "step_1"], s["spans"]
        assert s["spans"][0]["start"] == 0 and s["spans"][-1]["end"] == 400
    late = [ch for t, ch in admitted if t > answered]
    assert late, "no request was admitted after the update answered"
    for _, ch in admitted:
        assert len(_versions(ch["weight_versions"])) == 1 and _versions(ch["weight_versions"])[0] in ("default",
                                                                                                       "step_1")
    assert all(_versions(ch["weight_versions"]) == ["step_1"] for ch in late)
    (new_a, version_a), (new_b, version_b) = logprobs(a), logprobs(b)
    assert _worst(new_a, new_b) <= TOL and _worst(new_a, old) > 100 * TOL
    assert version_a == version_b == ["step_1"]
    assert _same_everywhere(a, b, "/weight_info") == {"weight_version": "step_1"}
    restore_server(server.url)
    assert _worst(logprobs(b)[0], old) <= TOL


def test_lora_loaded_through_one_process_is_served_by_both_exactly(server: ServerProcess, procs: Any,
                                                                    tmp_path: Path) -> None:
    """An adapter loaded through process A is listed and served by process B: its prompt logprobs there are
    transformers + PEFT's within 1e-4, beside a base request through A in the same batch; unloaded through B, A
    refuses it."""
    a, b = procs
    model_dir = Path(a.get("/server_info").json()["model"]["path"])
    base = load_file(str(model_dir / "model.safetensors"))
    path = write_adapter(tmp_path / "adapter", make_weights(base, seed=31))
    r = a.post("/load_lora_adapter", json={"lora_name": "ad", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    try:
        models = _same_everywhere(a, b, "/v1/models")
        assert [m["id"] for m in models["data"]] == [PRIME_MODEL, "ad"]
        prompt = _prompt(40, 3)
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 2, "prompt_logprobs": 1, "temperature": 1.0,
                                                        "seed": 1}}
        paths = sockets(server)

        async def both() -> list[dict[str, Any]]:
            async with avia(paths[0]) as ca, avia(paths[1]) as cb:
                rs = await asyncio.gather(cb.post(GEN, json={**body, "model": "ad"}), ca.post(GEN, json=body))
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
            return [r.json() for r in rs]

        with_adapter, plain = asyncio.run(both())
        want = PeftReference(model_dir, path).prompt_logprobs(prompt)
        assert _worst(_prompt_lps(with_adapter, prompt), want) <= TOL
        assert _worst(_prompt_lps(plain, prompt), PeftReference(model_dir, None).prompt_logprobs(prompt)) <= TOL
        assert _worst(want, PeftReference(model_dir, None).prompt_logprobs(prompt)) > 100 * TOL  # the check bites
    finally:
        r = b.post("/v1/unload_lora_adapter", json={"lora_name": "ad"})
        assert r.status_code == 200, r.text
    r = a.post(GEN, json={"token_ids": [1, 2], "model": "ad", "sampling_params": {"max_tokens": 1}})
    assert r.status_code == 404, r.text
    assert [m["id"] for m in _same_everywhere(a, b, "/v1/models")["data"]] == [PRIME_MODEL]


def test_drain_through_one_process_while_the_other_streams(server: ServerProcess, procs: Any) -> None:
    """A drain sent to process A counts and waits for process B's streams, which finish; B refuses new requests from
    the drain's answer on, and admits again once undrained through B."""
    a, b = procs
    paths = sockets(server)

    async def run() -> None:
        async with avia(paths[1]) as cb:
            firsts = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.ensure_future(read_stream(cb, stream_body(300, seed=i), first=firsts[i]))
                       for i in range(3)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 120)
            assert a.post("/pause", params={"mode": "keep"}).status_code == 200  # held in flight
            r = await asyncio.to_thread(a.post, "/drain", json={"timeout": 0.5})
            d = r.json()
            assert d["status"] == "timeout" and d["inflight_at_start"] == 3 and d["still_running"] == 3, d
            refused = await cb.post(GEN, json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}})
            assert refused.status_code == 503 and "draining" in refused.text
            assert (await cb.get("/ready")).json() == {"status": "not_ready", "reason": "draining"}
            assert b.post("/resume").status_code == 200
            for s in await asyncio.wait_for(asyncio.gather(*streams), 120):
                assert s["status"] == 200 and len(s["tokens"]) == 300 and not s["errors"], s
            state = b.get("/drain").json()
            assert state["draining"] and state["inflight"] == 0 and state["finished"] >= 3, state
            assert b.delete("/drain").json()["status"] == "admitting"
            ok = await cb.post(GEN, json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}})
            assert ok.status_code == 200, ok.text

    asyncio.run(run())


def test_abort_through_one_process_reaches_the_requests_of_the_other(server: ServerProcess, procs: Any) -> None:
    a, b = procs
    paths = sockets(server)

    async def run() -> None:
        async with avia(paths[0]) as ca, avia(paths[1]) as cb:
            firsts = [asyncio.Event() for _ in range(3)]
            bodies = [{**stream_body(300, seed=i), "request_id": f"ab-{i}"} for i in range(3)]
            clients = (cb, cb, ca)
            streams = [asyncio.ensure_future(read_stream(c, body, first=e))
                       for c, body, e in zip(clients, bodies, firsts, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 120)
            assert a.post("/pause", params={"mode": "keep"}).status_code == 200
            r = a.post("/abort_requests", json={"request_ids": ["ab-0"]})  # held by B
            assert r.json() == {"status": "aborted", "aborted": 1}, r.text
            first = await asyncio.wait_for(streams[0], 60)
            assert first["finish"] == "abort" and 0 < len(first["tokens"]) < 300
            r = b.post("/abort_requests", json={})  # every request, in both processes
            assert r.json() == {"status": "aborted", "aborted": 2}, r.text
            for s in await asyncio.wait_for(asyncio.gather(*streams[1:]), 60):
                assert s["finish"] == "abort", s
            assert b.post("/resume").status_code == 200

    asyncio.run(run())


def test_metrics_count_every_process_and_say_the_same_through_each(server: ServerProcess, procs: Any) -> None:
    a, b = procs
    route = {"route": GEN, "status": "200"}
    before = metric_value(a.get("/metrics").text, "tito_requests_total", route) or 0.0
    body = {"token_ids": [2, 3], "sampling_params": {"max_tokens": 2}}
    for c, n in ((a, 3), (b, 2)):
        for _ in range(n):
            assert c.post(GEN, json=body).status_code == 200
    for c in (a, b):
        text = c.get("/metrics").text
        assert metric_value(text, "tito_requests_total", route) == before + 5
        assert metric_value(text, "tito_inflight_requests") == 0
        assert 'tito_weight_version_info{version="default"} 1.0' in text
        assert metric_value(text, "vllm:request_success_total") is not None


# ------------------------------------------------------------------------------------------------ the end


@pytest.mark.ends_server("api2")
def test_sigterm_drains_every_api_process_then_stops_the_whole_server(ending_server: ServerProcess) -> None:
    """SIGTERM to ``tito serve``: both API processes refuse new work at once, the streams in flight in both finish
    whole, then every process exits (code 0), none left behind."""
    s = ending_server
    assert s.proc is not None
    paths = sockets(s)
    everyone = [psutil.Process(s.proc.pid), *family(s.proc.pid)]

    async def run() -> list[dict[str, Any]]:
        async with avia(paths[0]) as ca, avia(paths[1]) as cb:
            firsts = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.ensure_future(read_stream(c, stream_body(300, seed=i), first=firsts[i]))
                       for i, c in enumerate((ca, cb, ca, cb))]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 120)
            assert (await ca.post("/pause", params={"mode": "keep"})).status_code == 200  # in flight at the signal
            s.signal(signal.SIGTERM)

            async def stopping(c: httpx.AsyncClient) -> bool:
                return bool((await c.get("/ready")).json().get("reason") == "shutting_down")

            deadline = time.monotonic() + 30
            while not (await stopping(ca) and await stopping(cb)):
                assert time.monotonic() < deadline, "the API processes do not see the shutdown"
                await asyncio.sleep(0.05)
            for c in (ca, cb):
                r = await c.post(GEN, json={"token_ids": [1], "sampling_params": {"max_tokens": 1}})
                assert r.status_code == 503 and "shutting down" in r.text, r.text
            assert (await cb.post("/resume")).status_code == 200  # the drain waits for them: let them run
            return list(await asyncio.wait_for(asyncio.gather(*streams), 120))

    for st in asyncio.run(run()):
        assert st["status"] == 200 and len(st["tokens"]) == 300 and not st["errors"], st
    assert s.proc.wait(120) == 0, s.log_tail()
    assert wait_gone(everyone, 30) == []
    assert "4 request(s) finished during the drain, 0 aborted" in s.log_text()


# ------------------------------------------------------------------------------------------------ deaths


@module_server("api2-deaths")
def start_deaths(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> ServerProcess:
    """Two API processes over one engine core; the engine's death leaves 20 s before the exit (time for the checks),
    and the port's first answers are recorded while it starts."""
    def first(s: ServerProcess) -> dict[str, Any]:
        at = time.monotonic() - s.launched_at  # type: ignore[attr-defined]
        with httpx.Client(base_url=s.url, timeout=5.0) as c:
            return {"seconds": at, "health": c.get("/health"), "pause": c.post("/pause")}

    return start_tito(tmp_path_factory, tiny_model, "--api-server-count", "2", "--engine-death-exit-delay", "20",
                      name="api2-deaths", on_answer=first)


@pytest.fixture(scope="module")
def deaths(shared_servers: Any) -> ServerProcess:
    return shared_servers.get("api2-deaths")  # type: ignore[no-any-return]


def test_the_port_answers_starting_within_the_first_moments(deaths: ServerProcess) -> None:
    """Bound before vLLM is imported: the port's first answer is 503 "starting", in a small part of the start."""
    first = deaths.first_answers
    assert first["health"].status_code == 503 and first["health"].json() == {"status": "starting"}
    assert first["pause"].status_code == 503 and first["pause"].json()["error"]["message"] == "server is starting"
    healthy = next(st.seconds for st in reversed(ServerProcess.starts) if st.name == "api2-deaths")
    assert first["seconds"] < 0.25 * healthy, (first["seconds"], healthy)


def test_an_engine_death_then_a_dead_api_process_end_the_whole_server(deaths: ServerProcess) -> None:
    """The engine core killed: both API processes answer 503 "engine is dead" with the control process's cause, and
    their requests end; then an API process killed: the whole server stops at once, exit code 1, nothing left."""
    s = deaths
    assert s.proc is not None
    rows = _rows(s)
    paths = [r["socket"] for r in rows if r["role"] == "api"]
    api_pids = [r["pid"] for r in rows if r["role"] == "api"]
    everyone = [psutil.Process(s.proc.pid), *family(s.proc.pid)]
    core = next(p for p in everyone if "EngineCore" in p.name())

    async def streaming() -> dict[str, Any]:
        first = asyncio.Event()
        async with avia(paths[1]) as cb:
            task = asyncio.ensure_future(read_stream(cb, stream_body(400), first=first))
            await asyncio.wait_for(first.wait(), 60)
            with via(paths[0]) as a:
                assert a.post("/pause", params={"mode": "keep"}).status_code == 200
            core.kill()
            return await asyncio.wait_for(task, 60)

    st = asyncio.run(streaming())
    assert st["status"] == 200 and st["finish"] != "length" and len(st["tokens"]) < 400, st
    causes = []
    for p in paths:
        with via(p, 30) as c:
            deadline = time.monotonic() + 30
            while (h := c.get("/health")).status_code != 503:
                assert time.monotonic() < deadline, h.text
                time.sleep(0.05)
            assert h.json()["status"] == "dead"
            causes.append(h.json()["error"])
            r = c.post(GEN, json={"token_ids": [1], "sampling_params": {"max_tokens": 1}})
            assert r.status_code == 503 and "engine is dead" in r.text
    assert causes[0] == causes[1] and "EngineCore" in causes[0] and "SIGKILL" in causes[0]
    t0 = time.monotonic()
    psutil.Process(api_pids[1]).kill()
    assert s.proc.wait(15) == 1, s.log_tail()
    assert time.monotonic() - t0 < 15  # before the engine death's 20 s delay: the API process's death stopped it
    assert wait_gone(everyone, 30) == []
    log = s.log_text()
    assert "API process ApiServer_1" in log and "was killed by SIGKILL: stopping the server (exit code 1)" in log


def _rows(s: ServerProcess) -> list[dict[str, Any]]:
    return list(httpx.get(s.url + "/server_info", timeout=30).json()["api_processes"])

