"""Fast tests (fake engine) of the pause lease (app/server/control.py): a pause nobody ends is resumed by tito after
its lease, in the control queue (never in the middle of a transition, and a transition renews it), and a resume or
a new pause without a lease ends it. The real-engine test is tests/test_client.py
(test_a_pause_lease_ends_the_pause_nobody_ends)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import generate_latest

from app.server.control import ControlPlane
from tests.fake_engine import FakeEngine
from tests.helpers import metric_value


class _Weights:
    """What the control plane reads of the weight manager: no update outside its queue, consistent weights."""

    busy = False
    inconsistent: Any = None


def _plane() -> tuple[ControlPlane, FakeEngine]:
    engine = FakeEngine()
    return ControlPlane(engine, _Weights(), inflight=lambda: 0), engine  # type: ignore[arg-type]


def _expired() -> float:
    text = generate_latest().decode()  # tito's families are on the default registry
    return metric_value(text, "tito_pause_lease_expired_total", {"outcome": "resumed"}) or 0.0


async def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_the_lease_waits_for_a_running_transition_and_is_renewed_by_it() -> None:
    plane, engine = _plane()
    before = _expired()
    await plane.pause("keep", False, 10.0, lease=0.2)
    assert engine.paused and plane.info()["pause_lease_s"] == 0.2
    resumed_during: list[bool] = []

    async def update() -> None:  # a weight update that outlasts the lease, under the control lock
        await asyncio.sleep(0.6)
        resumed_during.append(not engine.paused)

    t0 = time.monotonic()
    await plane.run("weight update (step_1)", update, None)
    ended = time.monotonic()
    assert resumed_during == [False]  # the lease ran out meanwhile, but it never cut in
    assert engine.paused  # and the update renewed it: still paused right after
    await _until(lambda: not engine.paused)
    assert time.monotonic() - ended >= 0.15 and time.monotonic() - t0 >= 0.75
    assert [n for n, _ in plane.history] == ["pause (mode=keep)", "weight update (step_1)",
                                             "resume (pause lease expired)"]
    assert _expired() == before + 1
    assert plane.info()["pause_lease_s"] is None and plane.paused_mode is None


async def test_a_resume_or_a_pause_without_lease_ends_the_lease() -> None:
    plane, engine = _plane()
    before = _expired()
    await plane.pause("keep", False, 10.0, lease=0.1)
    await plane.resume(10.0)
    await plane.pause("keep", False, 10.0, lease=0.1)
    await plane.pause("keep", False, 10.0)  # a later pause without a lease: paused until /resume
    await asyncio.sleep(0.4)  # four leases' worth: nothing may fire
    assert engine.paused and _expired() == before
    assert [n for n, _ in plane.history][-1] == "pause (mode=keep)"
    await plane.resume(10.0)
    assert not engine.paused


async def test_the_lease_waits_for_an_update_outside_the_queue() -> None:
    """vLLM's native update (start .. finish) holds no control-queue turn; the lease waits for it like /resume."""
    plane, engine = _plane()
    done = asyncio.Event()

    class Native(_Weights):
        async def wait_idle(self, timeout: float) -> bool:
            try:
                await asyncio.wait_for(done.wait(), timeout)
            except TimeoutError:
                return False
            self.busy = False
            return True

    native = Native()
    plane.weights = native  # type: ignore[assignment]
    await plane.pause("keep", False, 10.0, lease=0.1)
    native.busy = True  # /start_weight_update, after the pause
    await asyncio.sleep(0.4)  # the lease ran out long ago, but the update is still open
    assert engine.paused
    done.set()  # /finish_weight_update
    await _until(lambda: not engine.paused)
    assert [n for n, _ in plane.history][-1] == "resume (pause lease expired)"
