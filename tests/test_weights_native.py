"""Weight-update serialization and integrity rules without an engine (a stub stands in for vLLM): vLLM's native
transfer steps share the one-update-at-a-time rule and the integrity rule with disk and broadcast updates; /resume
waits for them and refuses inconsistent weights. The real-engine evidence is in tests/test_weight_integrity.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.core import metrics
from app.core.protocol import ApiError
from app.server.control import ControlPlane
from app.weights.updates import UNTOUCHED, UpdateOutcome, WeightManager


class StubEngine:
    def __init__(self) -> None:
        self.paused = False
        self.calls: list[str] = []
        self.gate: asyncio.Event | None = None  # when set, engine calls wait for it
        self.fail: BaseException | None = None

    async def _step(self, name: str) -> None:
        self.calls.append(name)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            err, self.fail = self.fail, None
            raise err

    async def is_paused(self) -> bool:
        return self.paused

    async def pause(self, mode: str = "abort", clear_cache: bool = True, settle: bool = True) -> None:
        self.calls.append(f"pause:{mode}")
        self.paused = True

    async def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False

    async def set_weight_version(self, version: str) -> None:
        self.calls.append(f"version:{version}")

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append(f"reset:{reset_running_requests}")
        return True

    async def start_weight_update(self) -> None:
        await self._step("start")

    async def update_weights(self, info: Any) -> None:
        await self._step("update")

    async def finish_weight_update(self, version: str | None) -> None:
        await self._step("finish")


class StubState:
    def __init__(self) -> None:
        self.engine = StubEngine()
        self.settings = SimpleNamespace(model="/nonexistent")
        self.aborted = 0
        self.inflight = 0
        self.weights = WeightManager(self.engine, self.settings.model, abort=self.abort,  # type: ignore[arg-type]
                                     check_engine=self.check_engine)
        self.control = ControlPlane(self.engine, self.weights, inflight=lambda: self.inflight)  # type: ignore[arg-type]

    @property
    def weight_version(self) -> str:
        return self.weights.version

    async def abort(self, ids: list[str] | None = None) -> int:
        self.aborted += 1
        return 3

    def check_engine(self) -> None:
        return None


def gauge() -> float:
    return float(metrics.WEIGHTS_INCONSISTENT._value.get())


async def _until(cond: Any) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def test_native_update_is_one_update_and_blocks_others() -> None:
    async def main() -> None:
        st = StubState()
        mgr, eng = st.weights, st.engine
        await mgr.native("start", eng.start_weight_update)
        assert mgr.busy
        with pytest.raises(ApiError) as e:
            await mgr.native("start", eng.start_weight_update)
        assert e.value.status == 409 and "native weight update" in e.value.message

        async def disk() -> UpdateOutcome:
            raise AssertionError("must not run")

        with pytest.raises(ApiError) as e:
            await mgr.run("disk:x", disk)
        assert e.value.status == 409
        # Two update steps at once: the second is refused while the first runs.
        eng.gate = asyncio.Event()
        first = asyncio.ensure_future(mgr.native("update", lambda: eng.update_weights({})))
        await _until(lambda: eng.calls.count("update") == 1)
        with pytest.raises(ApiError) as e:
            await mgr.native("update", lambda: eng.update_weights({}))
        assert e.value.status == 409
        # /resume's wait: not idle until finish.
        waiter = asyncio.ensure_future(mgr.wait_idle(30))
        eng.gate.set()
        await first
        await asyncio.sleep(0)
        assert not waiter.done() and mgr.busy
        await mgr.native("finish", lambda: eng.finish_weight_update("v7"), "v7")
        assert await waiter is True
        assert not mgr.busy and st.weight_version == "v7"
        assert eng.calls[-1] == "reset:True"
        with pytest.raises(ApiError) as e:
            await mgr.native("finish", lambda: eng.finish_weight_update(None))
        assert e.value.status == 409 and "/start_weight_update" in e.value.message

    asyncio.run(main())


def test_native_failure_marks_inconsistent_until_a_good_update() -> None:
    async def main() -> None:
        st = StubState()
        mgr, eng = st.weights, st.engine
        await mgr.native("start", eng.start_weight_update)
        eng.fail = RuntimeError("nccl: peer went away")
        with pytest.raises(ApiError) as e:
            await mgr.native("update", lambda: eng.update_weights({}))
        assert e.value.status == 500
        assert mgr.inconsistent is not None and not mgr.busy and st.aborted == 1 and gauge() == 1
        with pytest.raises(ApiError) as e:
            mgr.check_consistent()
        assert e.value.status == 503
        assert e.value.message.startswith("weights are inconsistent after a failed update (update_weight_update: ")
        assert "peer went away" in e.value.message
        assert e.value.message.endswith("; POST /update_weights or /reload_weights")
        # A one-shot update outside start/finish is an update of its own and repairs the weights.
        await mgr.native("update", lambda: eng.update_weights({}))
        assert mgr.inconsistent is None and gauge() == 0
        mgr.check_consistent()

    asyncio.run(main())


def test_apply_integrity_and_who_resumes() -> None:
    async def main() -> None:
        st = StubState()
        mgr, eng = st.weights, st.engine

        async def broken() -> None:
            raise RuntimeError("I/O error reading shard 2")

        async def untouched() -> None:
            raise RuntimeError(f"{UNTOUCHED}trainer stalled before the first tensor")

        async def good() -> None:
            return None

        # Failed before touching the model: the old weights stand, the update's own pause is undone.
        with pytest.raises(ApiError):
            await mgr.apply("broadcast", untouched, "v1", 0)
        assert mgr.inconsistent is None and eng.calls[-1] == "resume" and not eng.paused
        # Failed midway while not paused by the caller: inconsistent, stays paused, held requests aborted.
        eng.calls.clear()
        with pytest.raises(ApiError) as e:
            await mgr.apply("disk", broken, "v2", 0, "loading weights from /x")
        assert e.value.status == 500 and "I/O error" in e.value.message
        assert mgr.inconsistent is not None and mgr.inconsistent.resume_on_recovery
        assert eng.paused and "resume" not in eng.calls and st.aborted == 1
        # The repairing update resumes what the failed one paused, once.
        out = await mgr.apply("reload", good, "default", 10)
        assert out.version == "default" and mgr.inconsistent is None and not eng.paused
        assert eng.calls.count("resume") == 1
        # Paused by the caller (pause?mode=keep): neither the failure nor the repair resumes.
        eng.paused = True
        eng.calls.clear()
        with pytest.raises(ApiError):
            await mgr.apply("disk", broken, "v3", 0)
        await mgr.apply("disk", good, "v4", 0)
        assert eng.paused and "resume" not in eng.calls

    asyncio.run(main())


def test_resume_route_refuses_inconsistent_weights() -> None:
    from app.server.state import get_state
    from routers import control

    st = StubState()
    st.engine.errored = False  # type: ignore[attr-defined]
    app = FastAPI()
    app.include_router(control.router)
    app.dependency_overrides[get_state] = lambda: st

    @app.exception_handler(ApiError)
    async def handler(request: Any, exc: ApiError) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"error": {"message": exc.message, "code": exc.status}}, exc.status)

    async def broken() -> None:
        raise RuntimeError("worker raised")

    with TestClient(app) as c:
        with pytest.raises(ApiError):
            asyncio.run(st.weights.apply("disk", broken, "v", 0))
        r = c.post("/resume")
        assert r.status_code == 409, r.text
        assert "weights are inconsistent after a failed update" in r.json()["error"]["message"]
        assert "resume" not in st.engine.calls


# ------------------------------------------------------------------------------ broadcast receive (the GPU path too)


class _Wire:
    """What the trainer puts on the wire (tests/weight_sender.py's encoding), replayed into the worker's receives."""

    def __init__(self, dicts: list[dict[str, Any]], fail_at: int | None = None) -> None:
        from tests.weight_sender import send_state_dicts

        self.sent: list[Any] = []

        class _Work:
            def wait(self) -> None:
                return None

        outer = self

        class _PG:
            def broadcast(self, ts: list[Any], opts: Any) -> _Work:
                outer.sent.append(ts[0].clone())
                return _Work()

        send_state_dicts(_PG(), dicts)
        self.pos = 0
        self.fail_at = fail_at
        self.events: list[str] = []
        self.closed = False

    def recv(self, t: Any, limit: float) -> None:
        if self.fail_at is not None and self.pos == self.fail_at:
            raise TimeoutError(f"NCCL broadcast not complete after {limit:g}s")
        t.copy_(self.sent[self.pos].view(t.shape))
        self.events.append(f"recv:{self.pos}")
        self.pos += 1

    def close(self) -> None:
        self.closed = True


def _worker(wire: _Wire) -> Any:
    import torch

    from app.engine.worker import TitoWorkerExtension
    from app.engine.worker_broadcast import Broadcaster

    class Worker(TitoWorkerExtension):
        device = torch.device("cpu")
        model_runner = SimpleNamespace(get_model=lambda: torch.nn.Linear(2, 2))
        vllm_config = SimpleNamespace(model_config=None)

        def __init__(self) -> None:
            self.loaded: dict[str, Any] = {}
            self._tito_bcast = Broadcaster(wire.recv, 1, 2, "nccl", 5.0, wire.close)

        def reload_weights(self, weights_iterator: Any) -> None:
            for name, t in weights_iterator:
                wire.events.append(f"load:{name}")
                self.loaded[name] = t.clone()

    return Worker()


def _dicts() -> list[dict[str, Any]]:
    import torch

    from tests.weight_sender import state_dicts

    sd = {"model.embed.weight": torch.randn(4, 3), "model.layers.0.w": torch.randn(3),
          "model.layers.1.w": torch.randn(3), "model.layers.2.w": torch.randn(2, 2)}
    return state_dicts(sd)


def test_broadcast_loads_each_state_dict_as_it_arrives() -> None:
    """No second copy of the weights: a state dict reaches the loader before the next one is received."""
    dicts = _dicts()
    wire = _Wire(dicts)
    w = _worker(wire)
    expected = {k: list(v.shape) for d in dicts for k, v in d.items()}
    out = w.tito_receive_broadcast(expected, 5.0)
    assert out["state_dicts"] == 4 and out["tensors"] == 4
    for d in dicts:
        for k, v in d.items():
            assert (w.loaded[k] == v).all()
    ev = wire.events
    # The first layer is loaded before the last state dict's first receive (its metadata length).
    last_recv = ev.index(f"recv:{len(wire.sent) - 3}")
    assert ev.index("load:model.layers.0.w") < last_recv


def test_broadcast_timeout_midway_drops_the_group_and_is_not_untouched() -> None:
    """A receive that times out after the reload started: the communicator is closed (on GPU: ncclCommAbort) and
    the error has no UNTOUCHED marker, so the server marks the weights inconsistent instead of hanging."""
    dicts = _dicts()
    wire = _Wire(dicts, fail_at=8)  # count + 3 per one-dtype state dict: fails inside the third state dict
    w = _worker(wire)
    expected = {k: list(v.shape) for d in dicts for k, v in d.items()}
    with pytest.raises(Exception) as e:
        w.tito_receive_broadcast(expected, 5.0)
    assert "TITO_TIMEOUT" in str(e.value) and UNTOUCHED not in str(e.value)
    assert "group was dropped" in str(e.value)
    assert wire.closed and w._tito_bcast is None
    assert "load:model.embed.weight" in wire.events


def test_broadcast_failure_before_the_reload_leaves_the_model_untouched() -> None:
    dicts = _dicts()
    wire = _Wire(dicts, fail_at=2)  # inside the first state dict
    w = _worker(wire)
    expected = {k: list(v.shape) for d in dicts for k, v in d.items()}
    with pytest.raises(Exception) as e:
        w.tito_receive_broadcast(expected, 5.0)
    assert UNTOUCHED in str(e.value) and not w.loaded and wire.closed
    # A state dict that names a tensor the model lacks is refused before it reaches the model.
    bad = _dicts()
    bad[1]["model.layers.0.extra"] = bad[1]["model.layers.0.w"]
    wire = _Wire(bad)
    w = _worker(wire)
    with pytest.raises(ValueError) as e2:
        w.tito_receive_broadcast(expected, 5.0)
    assert "TITO_CLIENT_ERROR" in str(e2.value) and "model.layers.0.extra" in str(e2.value)
    assert "load:model.layers.0.w" not in wire.events and "load:model.layers.0.extra" not in wire.events
