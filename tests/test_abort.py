"""Aborts on a real engine: client disconnects (stream and non-stream) free the engine at once; ``/abort_requests``
by the client's id, by the ``generate-tokens-`` id, or everything; aborted requests answer with partial tokens.

Basis for the bound on "running requests back to 0": the abort reaches the EngineCore on the next loop turn and
vLLM republishes ``vllm:num_requests_running`` with the next scheduler step; measured well under 0.1 s here. The bound
is 5 s all the same: it is timed by this test process, which a busy 2-core machine can deschedule for seconds. What
makes it a test of the abort is that the requests are frozen (``/pause?mode=keep``) before the clients go away: frozen,
they can only leave the engine by being aborted, never by finishing. The requests that ``/abort_requests`` targets are
endless (``ENDLESS`` tokens, more than any machine generates within a test), so only the abort can end them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest

from tests.helpers import (
    TIMING,
    ServerProcess,
    metric_value,
    restore_server,
)
from tests.streaming import (
    GEN,
    async_client,
    count_set,
    inflight,
    pause_keep,
    read_stream,
    resume,
    stream_body,
    wait_for,
)

pytestmark = pytest.mark.engine

BOUND_S = 5.0
# Tokens per long request: seconds of decoding even on a quiet machine (480 tokens take ~1 s there, and the first
# token a client sees can lag by as much when outputs are merged), so a request seen running is still running when
# the test freezes it with ``/pause?mode=keep``.
LONG = 4000
# max_tokens of a request only an abort ends: it cannot finish within a test on any machine (~1500 tokens/s at most
# here). The KV cache (~1 KiB per token for the tiny model, 1 GiB) holds ~17 such requests at full length.
ENDLESS = 60000  # fits the shared long-context server (conftest.LONG_CONTEXT)


@pytest.fixture(scope="module")
def server(long_tito: ServerProcess) -> Iterator[ServerProcess]:
    """The shared long-context server: nothing else runs on it during this module; put back as found at the end."""
    yield long_tito
    restore_server(long_tito.url)


async def _engine_counts(c: httpx.AsyncClient) -> tuple[float, float]:
    text = (await c.get("/metrics")).text
    running = metric_value(text, "vllm:num_requests_running")
    waiting = metric_value(text, "vllm:num_requests_waiting")
    assert running is not None and waiting is not None
    return running, waiting


async def _time_to_idle(c: httpx.AsyncClient, t0: float) -> float:
    async def idle() -> bool:
        running, waiting = await _engine_counts(c)
        return running == 0 and waiting == 0

    await wait_for(idle, 30, interval=0.02)
    return time.monotonic() - t0


@TIMING
def test_disconnecting_32_streams_frees_the_engine(server: ServerProcess) -> None:
    n = 32

    async def run() -> None:
        async with async_client(server.url) as c:
            firsts = [asyncio.Event() for _ in range(n)]
            tasks = [asyncio.ensure_future(read_stream(c, stream_body(LONG, i), firsts[i])) for i in range(n)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
            running, _ = await _engine_counts(c)
            assert running >= 1  # the engine really is busy with them
            took = await _disconnect_frozen(c, tasks)  # closes each response mid-stream
            print(f"{n} streams disconnected with {running:.0f} running: engine idle after {took:.3f}s")
            assert took <= BOUND_S
            await wait_for(lambda: _inflight_zero(c), 10)

    asyncio.run(run())


async def _inflight_zero(c: httpx.AsyncClient) -> bool:
    return (await c.get("/drain")).json()["inflight"] == 0


async def _disconnect_frozen(c: httpx.AsyncClient, tasks: Sequence[asyncio.Future[Any]]) -> float:
    """Freeze the engine, cancel every client task (the client is gone), and return the seconds until the engine
    is idle: from the freeze on, only the server's abort can take the requests out of the engine."""
    try:
        await pause_keep(c)
        assert (await inflight(c)) >= 1  # frozen in flight, not finished
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return await _time_to_idle(c, time.monotonic())
    finally:
        await resume(c)


@TIMING
def test_disconnecting_non_stream_clients_frees_the_engine(server: ServerProcess) -> None:
    n = 16
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": LONG, "temperature": 0, "ignore_eos": True}}

    async def run() -> None:
        async with async_client(server.url) as c:
            tasks = [asyncio.ensure_future(c.post(GEN, json=body)) for _ in range(n)]

            async def all_running() -> bool:
                running, _ = await _engine_counts(c)
                return running >= n

            await wait_for(all_running, 120)
            took = await _disconnect_frozen(c, tasks)
            print(f"{n} non-stream clients disconnected: engine idle after {took:.3f}s")
            assert took <= BOUND_S
            await wait_for(lambda: _inflight_zero(c), 10)

    asyncio.run(run())


def test_abort_by_client_id_and_by_generate_tokens_id(server: ServerProcess) -> None:
    # Each request is endless: it is surely still in flight when the abort arrives, however fast or slow the machine,
    # and the abort is what ends it, with its partial tokens.
    async def run() -> None:
        async with async_client(server.url) as c:
            try:
                # A stream named by the X-Request-Id header, aborted by that id.
                first = asyncio.Event()
                s = asyncio.ensure_future(read_stream(c, stream_body(ENDLESS), first,
                                                      headers={"X-Request-Id": "ab-1"}))
                await asyncio.wait_for(first.wait(), 120)
                assert not s.done()
                r = await c.post("/abort_requests", json={"request_ids": ["ab-1"]})
                assert r.status_code == 200 and r.json() == {"status": "aborted", "aborted": 1}
                res = await asyncio.wait_for(s, 60)
                assert res["status"] == 200 and res["done"] and not res["errors"]
                assert res["finish"] == "abort" and 0 < len(res["tokens"]) < ENDLESS

                # A non-stream request named in the body, aborted by the id the answer carries (vLLM's alias route).
                body = {"token_ids": [9, 9, 9], "request_id": "ab-2",
                        "sampling_params": {"max_tokens": ENDLESS, "temperature": 0, "ignore_eos": True}}
                generated0 = await _generated_tokens(c)
                task = asyncio.ensure_future(c.post(GEN, json=body))
                # It has produced tokens (the engine counted them; nothing else runs on this module's server).
                await wait_for(lambda: _generated_more_than(c, generated0), 120, interval=0.01)
                assert not task.done()
                r = await c.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-ab-2"]})
                assert r.json() == {"status": "aborted", "aborted": 1}
                ans = (await asyncio.wait_for(task, 60)).json()
                assert ans["request_id"] == "generate-tokens-ab-2"
                choice = ans["choices"][0]
                assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < ENDLESS
                assert ans["usage"]["completion_tokens"] == len(choice["token_ids"])
            finally:
                await c.post("/abort_requests", json={})  # nothing endless is left behind, whatever failed
            await wait_for(lambda: _inflight_zero(c), 10)

    asyncio.run(run())


async def _generated_tokens(c: httpx.AsyncClient) -> float:
    return metric_value((await c.get("/metrics")).text, "vllm:generation_tokens_total") or 0.0


async def _generated_more_than(c: httpx.AsyncClient, before: float) -> bool:
    return await _generated_tokens(c) > before


@TIMING  # for the engine-idle bound only; that `{}` ends all n streams is deterministic
def test_abort_everything(server: ServerProcess) -> None:
    n = 8

    async def run() -> list[dict[str, Any]]:
        async with async_client(server.url) as c:
            firsts = [asyncio.Event() for _ in range(n)]
            tasks = [asyncio.ensure_future(read_stream(c, stream_body(ENDLESS, i), firsts[i])) for i in range(n)]
            try:
                # Every stream has tokens; endless, all n are surely in flight when `{}` arrives.
                await wait_for(lambda: count_set(firsts, n), 120)
                assert not any(t.done() for t in tasks)
                r = await c.post("/abort_requests", json={})
                assert r.json() == {"status": "aborted", "aborted": n}
                results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                took = await _time_to_idle(c, time.monotonic())
                assert took <= BOUND_S
            finally:
                for t in tasks:
                    t.cancel()
                await c.post("/abort_requests", json={})  # nothing endless is left behind, whatever failed
            await wait_for(lambda: _inflight_zero(c), 10)
            return results

    for res in asyncio.run(run()):
        assert res["status"] == 200 and res["done"] and not res["errors"]
        assert res["finish"] == "abort" and 0 < len(res["tokens"]) < ENDLESS


def test_abort_unknown_ids_and_bad_bodies(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.post("/abort_requests", json={"request_ids": ["nope"]}).json() == {"status": "aborted", "aborted": 0}
        assert c.post("/abort_requests").json() == {"status": "aborted", "aborted": 0}  # no body: all (none running)
        r = c.post("/abort_requests", json={"request_ids": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body.request_ids"
