"""A dead EngineCore (killed with SIGKILL): probes, errors and in-flight streams say so within 2 s, the failure is in
the server metadata, and the server exits non-zero (or, with ``--exit-on-engine-death false``, stays up).

Basis for the 2 s bound: vLLM's engine monitor thread wakes on the EngineCore process sentinel at once and tito's
watcher polls every 0.1 s; measured ~0.1 s on an idle machine and under a load average of 9 on 2 cores. It is checked
on the server's own clock (``since`` in the dead /health answer, the moment tito recorded the death), so a test process
descheduled for a while cannot fail it. The streams' end is seen by the test process, which on a busy 2-core machine can
be seconds late; it gets a looser bound (a stream that did not end would hang until the 30 s wait gives up).

The streams are long (4000 tokens, on the tiny model with a longer context), so they are surely still generating when
the engine is killed, even if this process sees their first tokens late.

Each test ends its server: it takes a shared one at the end of its life (``ends_server``, tests/conftest.py) and runs
after that server's last other user.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import httpx
import psutil
import pytest

from tests.helpers import (
    TIMING,
    ServerProcess,
)
from tests.streaming import GEN, async_client, read_stream, stream_body, wait_for, wait_gone

pytestmark = pytest.mark.engine

BOUND_S = 2.0
STREAMS_BOUND_S = 10.0
LONG = 4000


def _engine_core(server: ServerProcess) -> psutil.Process:
    assert server.proc is not None
    cores = [p for p in psutil.Process(server.proc.pid).children(recursive=True) if "EngineCore" in p.name()]
    assert len(cores) == 1, cores
    return cores[0]


async def _kill_and_observe(server: ServerProcess, n_streams: int) -> dict[str, Any]:
    """Kill the EngineCore under ``n_streams`` in-flight streams; return what was seen and when (s after the kill)."""
    async with async_client(server.url) as c:
        firsts = [asyncio.Event() for _ in range(n_streams)]
        ended: list[float] = []

        async def one(i: int) -> dict[str, Any]:
            res = await read_stream(c, stream_body(LONG, i), firsts[i])
            ended.append(time.monotonic())
            return res

        streams = [asyncio.ensure_future(one(i)) for i in range(n_streams)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
        core = _engine_core(server)
        wall0 = time.time()
        core.send_signal(signal.SIGKILL)
        t0 = time.monotonic()

        async def health_dead() -> httpx.Response | None:
            r = await c.get("/health")
            return r if r.status_code == 503 else None

        health = await wait_for(health_dead, 30, interval=0.02)
        t_health = time.monotonic() - t0
        results = await asyncio.wait_for(asyncio.gather(*streams), 30)
        seen = {
            "core_pid": core.pid,
            "t_health": t_health,
            "t_detected": health.json()["since"] - wall0,  # on the server's clock
            "t_streams": max(ended) - t0,
            "health": health.json(),
            "ready": await c.get("/ready"),
            "generate": await c.post(GEN, json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}),
            "liveness": await c.get("/liveness"),
            "server_info": (await c.get("/server_info")).json(),
            "t_all": time.monotonic() - t0,
            "streams": results,
        }
        print(f"engine killed: /health 503 after {t_health:.3f}s, all {n_streams} streams ended after "
              f"{seen['t_streams']:.3f}s, probes/generate checked by {seen['t_all']:.3f}s")
        return seen


def _check_dead(seen: dict[str, Any]) -> None:
    cause = f"EngineCore (pid {seen['core_pid']}) was killed by SIGKILL"
    assert 0 <= seen["t_detected"] <= BOUND_S, seen["t_detected"]
    assert seen["t_streams"] <= STREAMS_BOUND_S, seen["t_streams"]
    assert seen["health"]["status"] == "dead" and cause in seen["health"]["error"]
    assert seen["ready"].status_code == 503 and seen["ready"].json()["reason"] == "engine_dead"
    g = seen["generate"]
    assert g.status_code == 503
    assert g.json() == {"error": {"message": f"engine is dead: {cause}", "type": "ServiceUnavailableError",
                                  "param": None, "code": 503}}
    lv = seen["liveness"]
    assert lv.status_code == 503 and lv.json()["status"] == "engine_unresponsive"
    for res in seen["streams"]:
        assert res["status"] == 200 and res["done"]
        assert len(res["tokens"]) < LONG
        assert [e["message"] for e in res["errors"]] == [f"engine is dead: {cause}"]
    state = seen["server_info"]["state"]
    assert state["engine"] == "dead" and cause in state["engine_error"]
    assert state["ready"] is False
    assert abs(seen["health"]["since"] - time.time()) < 60  # the failure's wall-clock time


@TIMING
@pytest.mark.ends_server("long_tito")
def test_engine_death_then_exit_nonzero(ending_server: ServerProcess) -> None:
    # The shared long-context server at the end of its life (conftest.py: --engine-death-exit-delay 20, which leaves
    # the checks after the kill, several requests, time to finish on a busy machine).
    s = ending_server
    assert s.proc is not None
    log_start = len(s.log_text())
    family = psutil.Process(s.proc.pid).children(recursive=True)
    seen = asyncio.run(_kill_and_observe(s, 4))
    _check_dead(seen)
    code = s.proc.wait(90)
    assert code == 1, s.log_tail()
    assert wait_gone(family, 15) == []
    assert "engine is dead: EngineCore" in s.log_text()[log_start:]


@TIMING
@pytest.mark.ends_server("lora_tito")
def test_engine_death_stays_up_for_inspection(ending_server: ServerProcess) -> None:
    # The shared LoRA server at the end of its life (conftest.py: a 4,192-token context, --exit-on-engine-death false,
    # --engine-death-exit-delay 0.5).
    s = ending_server
    assert s.proc is not None
    log_start = len(s.log_text())
    seen = asyncio.run(_kill_and_observe(s, 2))
    _check_dead(seen)
    # The watcher's decision (tito/main.py): it logs that it stays up where it would otherwise schedule the exit.
    deadline = time.monotonic() + 30
    while "staying up for inspection" not in s.log_text()[log_start:]:
        assert time.monotonic() < deadline and s.proc.poll() is None, s.log_tail()
        time.sleep(0.05)
    assert "exiting with code 1" not in s.log_text()[log_start:]
    assert s.proc.poll() is None
    r = httpx.get(s.url + "/health", timeout=30)
    assert r.status_code == 503 and r.json()["status"] == "dead"
