"""Probes, drain and SIGTERM on a real engine.

The drain tests use the session's shared default server (they leave it undrained and resumed, also when they fail).
Each SIGTERM test ends its server: it takes a shared one at the end of its life (``ends_server``, tests/conftest.py)
and runs after that server's last other user.

Requests are held in flight on purpose with ``POST /pause?mode=keep`` (they freeze in the engine and continue after
``/resume``) while the test checks what a drain or a shutdown looks like from outside: on a quiet machine the tiny
model finishes a few hundred tokens in well under a second, faster than the checks. Waits are on real signals
(first streamed token, the in-flight count), never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ADMIN_KEY, FUZZ_ADMIN_KEY, FUZZ_MAX_MODEL_LEN, KEYED_MAX_MODEL_LEN, KEYED_MAX_NUM_SEQS
from tests.helpers import (
    TIMING,
    ServerProcess,
    restore_server,
)
from tests.streaming import (
    GEN,
    async_client,
    count_set,
    family,
    inflight,
    pause_keep,
    read_stream,
    resume,
    stream_body,
    wait_for,
    wait_gone,
)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def server(tito: ServerProcess) -> Iterator[ServerProcess]:
    """The shared default server (the drain tests leave it undrained and resumed; checked again at the end)."""
    yield tito
    restore_server(tito.url)


def assert_busy_503(r: httpx.Response, word: str) -> None:
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) > 0
    err = r.json()["error"]
    assert err["code"] == 503 and err["type"] == "ServiceUnavailableError"
    assert word in err["message"]


# --------------------------------------------------------------------------------------------------- probes


def test_probes_while_serving(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        h = c.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["state"] == "serving"
        r = c.get("/ready")
        assert r.status_code == 200 and r.json() == {"status": "ready"}
        lv = c.get("/liveness")
        assert lv.status_code == 200 and lv.json()["status"] == "ok"
        d = c.get("/drain").json()
        assert d["draining"] is False and d["inflight"] == 0


# --------------------------------------------------------------------------------------------------- drain


@TIMING
def test_drain_under_64_streams(server: ServerProcess) -> None:
    n, max_tokens = 64, 256
    half = n // 2

    async def run() -> None:
        async with async_client(server.url) as c:
            firsts = [asyncio.Event() for _ in range(n)]
            streams: list[asyncio.Future[Any]] = []
            try:
                # Half of the streams are generating when the drain starts, half are queued; all are frozen
                # (pause mode=keep), so the drain surely starts with at least the queued half in flight however
                # fast or slow the machine. The first half is admitted while frozen (so all of it is in flight at
                # once), then generates until one has a token; the second half arrives while frozen again.
                await pause_keep(c)
                streams += [asyncio.ensure_future(read_stream(c, stream_body(max_tokens, i), firsts[i]))
                            for i in range(half)]
                await wait_for(lambda: _inflight_is(c, half), 120)
                await resume(c)
                await asyncio.wait_for(firsts[0].wait(), 180)
                await pause_keep(c)
                running = await inflight(c)  # those of the first half that have not finished yet
                admitted = [asyncio.Event() for _ in range(half, n)]
                streams += [asyncio.ensure_future(read_stream(c, stream_body(max_tokens, i), firsts[i],
                                                              admitted=admitted[i - half]))
                            for i in range(half, n)]
                await wait_for(lambda: count_set(admitted, half), 120)
                # Frozen, so none can finish now (one whose last token came just before the pause may still be
                # answering): the count can only go down to the queued half plus those frozen mid-way.
                held = await inflight(c)
                assert half <= held <= running + half, (held, running)
                drain = asyncio.ensure_future(c.post("/drain", json={"timeout": 180}))
                await wait_for(lambda: _draining(c), 60)

                # New work is refused with a clear 503 + Retry-After; probes and admin routes keep answering.
                assert_busy_503(await c.post(GEN, json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}),
                                "draining")
                r = await c.post(GEN, json=stream_body(2))
                assert_busy_503(r, "draining")
                ready = await c.get("/ready")
                assert ready.status_code == 503 and ready.json() == {"status": "not_ready", "reason": "draining"}
                health = await c.get("/health")
                assert health.status_code == 200 and health.json()["state"] == "draining"
                assert (await c.get("/liveness")).status_code == 200
                assert (await c.get("/v1/models")).status_code == 200
                assert (await c.get("/is_paused")).status_code == 200
                assert not drain.done()  # the frozen requests are still in flight

                await resume(c)
                answer = (await asyncio.wait_for(drain, 180)).json()
                results = await asyncio.wait_for(asyncio.gather(*streams), 180)
                print(f"drain answer: {answer}")
                assert answer["status"] == "drained"
                assert answer["still_running"] == 0 and answer["inflight"] == 0
                assert half <= answer["inflight_at_start"] <= held
                assert answer["finished"] == answer["inflight_at_start"]
                for res in results:
                    assert res["status"] == 200 and res["done"] and not res["errors"]
                    assert len(res["tokens"]) == max_tokens and res["finish"] == "length"

                undrain = await c.delete("/drain")
                assert undrain.status_code == 200 and undrain.json()["draining"] is False
                assert (await c.get("/ready")).status_code == 200
                ok = await c.post(GEN, json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
                assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2
            finally:
                await _restore(c, streams)

    asyncio.run(run())


async def _restore(c: httpx.AsyncClient, tasks: list[asyncio.Future[Any]]) -> None:
    """Leave the shared server as the next test expects it: generating, admitting, nothing in flight."""
    await c.post("/resume")
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await c.delete("/drain")
    await wait_for(lambda: _idle(c), 30)


async def _idle(c: httpx.AsyncClient) -> bool:
    return await inflight(c) == 0


async def _draining(c: httpx.AsyncClient) -> bool:
    return bool((await c.get("/drain")).json()["draining"])


@TIMING
def test_drain_timeout_reports_still_running_and_does_not_abort(server: ServerProcess) -> None:
    async def run() -> None:
        async with async_client(server.url) as c:
            streams: list[asyncio.Future[Any]] = []
            try:
                # Frozen before it starts: the request is in flight (admitted, queued in the engine) and cannot
                # finish within the drain's timeout however fast the machine is.
                await pause_keep(c)
                streams.append(asyncio.ensure_future(read_stream(c, stream_body(480))))
                await wait_for(lambda: _inflight_is(c, 1), 60)
                answer = (await c.post("/drain", json={"timeout": 0.05})).json()
                assert answer["status"] == "timeout" and answer["draining"] is True
                assert answer["still_running"] == 1 and answer["finished"] == 0
                # The drain did not abort it: once generation resumes it runs to the end.
                await resume(c)
                res = await asyncio.wait_for(streams[0], 120)
                assert len(res["tokens"]) == 480 and res["finish"] == "length"
                status = (await c.get("/drain")).json()
                assert status["inflight"] == 0 and status["finished"] == 1
                # POST /undrain is the other spelling of DELETE /drain.
                assert (await c.post("/undrain")).json()["draining"] is False
                assert (await c.get("/ready")).status_code == 200
            finally:
                await _restore(c, streams)

    asyncio.run(run())


async def _inflight_is(c: httpx.AsyncClient, k: int) -> bool:
    return await inflight(c) == k


async def _running_then_queued(c: httpx.AsyncClient, n: int, seats: int,
                               max_tokens: int) -> list[asyncio.Future[dict[str, Any]]]:
    """Start ``n`` streams: the first ``seats`` are admitted while frozen (all in flight at once), then generate
    until each has a token; the rest arrive while frozen again, so they are surely queued, however fast the machine
    or however late this process sees the first tokens. Returns with the engine frozen (``pause mode=keep``)."""
    await pause_keep(c)
    firsts = [asyncio.Event() for _ in range(n)]
    admitted = [asyncio.Event() for _ in range(n)]
    streams: list[asyncio.Future[dict[str, Any]]] = [
        asyncio.ensure_future(read_stream(c, stream_body(max_tokens, i), firsts[i])) for i in range(seats)]
    await wait_for(lambda: _inflight_is(c, seats), 120)
    await resume(c)
    await wait_for(lambda: count_set(firsts[:seats], seats), 120)
    await pause_keep(c)
    streams += [asyncio.ensure_future(read_stream(c, stream_body(max_tokens, i), firsts[i], admitted=admitted[i]))
                for i in range(seats, n)]
    await wait_for(lambda: count_set(admitted[seats:], n - seats), 120)
    return streams


def test_drain_body_is_validated(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        try:
            assert c.get("/drain").json()["draining"] is False
            r = c.post("/drain", json={"timeout": -1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "body.timeout"
            assert c.get("/drain").json()["draining"] is False  # a refused drain does not start one
            r = c.post("/drain", content=b"{not json", headers={"Content-Type": "application/json"})
            assert r.status_code == 400
            assert c.get("/drain").json()["draining"] is False
        finally:
            c.delete("/drain")


# --------------------------------------------------------------------------------------------------- SIGTERM


def _admin_client(s: ServerProcess, key: str) -> httpx.AsyncClient:
    c = async_client(s.url)
    c.headers["Authorization"] = f"Bearer {key}"  # the admin key opens every route
    return c


@TIMING
@pytest.mark.ends_server("keyed_tito")
def test_sigterm_drains_in_flight_then_exits_0(ending_server: ServerProcess) -> None:
    # The shared keyed server at the end of its life (conftest.py: --shutdown-timeout 600, 4 sequences at a time). 16
    # requests on its 4 seats: most are still queued in the engine when SIGTERM arrives; they finish too.
    s = ending_server
    assert s.proc is not None
    procs = family(s.proc.pid)
    assert any("EngineCore" in p.name() for p in procs)
    seats = KEYED_MAX_NUM_SEQS
    n, max_tokens = 4 * seats, KEYED_MAX_MODEL_LEN - 28  # a 4-token prompt: the whole answer fits the context
    log_start = len(s.log_text())

    async def run() -> list[dict[str, Any]]:
        async with _admin_client(s, ADMIN_KEY) as c:
            # 4 running (they have tokens), 12 queued; frozen, so none of the queued can finish before the checks
            # below. Without this a quiet machine finishes the whole load in about a second, the drain ends, and the
            # server legitimately stops listening before the test's own probes are sent.
            streams = await _running_then_queued(c, n, seats, max_tokens)
            s.signal(signal.SIGTERM)
            t0 = time.monotonic()
            ready = await wait_for(lambda: _not_ready(c), 60)
            assert ready == {"status": "not_ready", "reason": "shutting_down"}
            # The listener stays open during the drain: new work gets a 503 it can retry elsewhere.
            assert_busy_503(await c.post(GEN, json={"token_ids": [1], "sampling_params": {"max_tokens": 1}}),
                            "shutting down")
            health = (await c.get("/health")).json()
            # At most the running ones can have finished before the pause; the queued ones are still there.
            assert health["state"] == "shutting_down" and health["inflight"] >= n - seats, health
            await resume(c)  # the admin routes keep working while shutting down
            results = await asyncio.wait_for(asyncio.gather(*streams), 120)
            print(f"all {n} streams done {time.monotonic() - t0:.1f}s after SIGTERM")
            return results

    results = asyncio.run(run())
    for res in results:
        assert res["status"] == 200 and res["done"] and not res["errors"], res
        assert len(res["tokens"]) == max_tokens and res["finish"] == "length"
    code = s.proc.wait(120)
    assert code == 0, s.log_tail()
    assert wait_gone(procs, 15) == []
    log = s.log_text()[log_start:]  # what this server logged since the signal's test began
    assert "draining" in log and "0 aborted" in log
    # A clean exit is quiet: no interpreter teardown in which Triton's nanobind bindings list "leaked" objects.
    assert "nanobind: leaked" not in log, log[-3000:]


@TIMING
@pytest.mark.ends_server("fuzz_tito")
def test_second_signal_aborts_in_flight_and_exits_0(ending_server: ServerProcess) -> None:
    # The shared fuzzing server at the end of its life (conftest.py: --shutdown-timeout 600, 4 sequences at a time).
    s = ending_server
    assert s.proc is not None
    procs = family(s.proc.pid)
    n, max_tokens, seats = 16, FUZZ_MAX_MODEL_LEN - 16, 4

    async def run() -> tuple[list[dict[str, Any]], float]:
        async with _admin_client(s, FUZZ_ADMIN_KEY) as c:
            # 4 running, 12 queued, all frozen: with a 600 s drain, only the second signal can end them, however
            # fast the machine is.
            streams = await _running_then_queued(c, n, seats, max_tokens)
            s.signal(signal.SIGTERM)
            await wait_for(lambda: _not_ready(c), 60)
            s.signal(signal.SIGINT)  # shortens the 600 s drain to now
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*streams), 120)
            return results, time.monotonic() - t0

    results, took = asyncio.run(run())
    print(f"streams ended {took:.1f}s after the second signal")
    assert took < 60, "the second signal must not wait out the 600 s drain"
    finishes = [r["finish"] for r in results]
    # Frozen in flight, so aborted: at most the first wave of 4 can have finished before the pause; the 12
    # queued behind them surely had not.
    assert finishes.count("abort") >= n - seats, finishes
    for res in results:
        assert res["status"] == 200 and res["done"] and not res["errors"], res
        if res["finish"] == "abort":
            assert len(res["tokens"]) < max_tokens  # partial: what was generated before the abort
        else:
            assert res["finish"] == "length" and len(res["tokens"]) == max_tokens
    code = s.proc.wait(120)
    assert code == 0, s.log_tail()
    assert wait_gone(procs, 15) == []


async def _not_ready(c: httpx.AsyncClient) -> dict[str, Any] | None:
    r = await c.get("/ready")
    return r.json() if r.status_code == 503 else None


@TIMING
@pytest.mark.ends_server("lora_tito")
def test_a_stop_signal_to_the_whole_group_is_a_shutdown_not_a_death(ending_server: ServerProcess) -> None:
    # A stop signal to tito's whole process group (Ctrl-C in a terminal; systemd's default stop signals every process
    # of the unit) reaches the EngineCore too, which may exit before tito's own handler has run: the race a loaded
    # server lost at the end of a seed run. Here the EngineCore gets SIGTERM first and tito 0.3 s after it has gone
    # (tito's engine watcher has seen it by then): tito counts the engine's stop as part of its shutdown, exits 0, and
    # logs no engine death.
    s = ending_server
    assert s.proc is not None
    procs = family(s.proc.pid)
    core = next(p for p in procs if "EngineCore" in p.name())
    log_start = len(s.log_text())
    core.send_signal(signal.SIGTERM)
    core.wait(30)
    time.sleep(0.3)  # the skew under test, not a wait for an event
    s.signal(signal.SIGTERM)
    assert s.proc.wait(120) == 0, s.log_tail()
    assert wait_gone(procs, 15) == []
    log = s.log_text()[log_start:]
    assert "engine stopped during shutdown" in log and "engine is dead" not in log, log[-3000:]
