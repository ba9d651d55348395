"""Fast tests (fake engine, tests/fake_engine.py) of the weight record (app/weights/record.py) and its restore at start
(app/weights/restore.py): what is written after each kind of commit, that a new server on the same ``--state-dir``
comes back at the recorded version before it is ready, and that a record it cannot restore keeps it not ready
(never the base weights). The real-engine evidence (a SIGKILLed replica restarted in a Dynamo fleet, its answers
compared with a replica that never restarted) is tests/test_sidecar_fleet.py."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.client.commands import format_status
from app.core.settings import Settings
from app.tiny.model import make_tiny_model, tiny_state_dict
from app.weights.record import WeightRecord, resolve_state_dir, write_atomic
from tests import prime_stage_client as prime
from tests.delta_encoder import perturb, write_delta
from tests.fake_engine import FakeEngine
from tests.test_weights import write_step
from tito.main import create_app


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("record")


@pytest.fixture(scope="module")
def model_dir(root: Path) -> Path:
    return make_tiny_model(root / "tiny", tokenizer=False)


@asynccontextmanager
async def serve(model_dir: Path, root: Path, state_dir: Path,
                engine: FakeEngine | None = None) -> AsyncIterator[tuple[httpx.AsyncClient, FakeEngine]]:
    engine = engine or FakeEngine()
    s = Settings.build(env={}, model=str(model_dir), warmup=False, allowed_weight_root=[str(root)],
                       staging_dir=str(root), state_dir=str(state_dir))
    app = create_app(s, engine=engine)  # type: ignore[arg-type]
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tito",
                                     timeout=30) as c:
            yield c, engine


def _record(state_dir: Path) -> dict[str, Any]:
    return dict(json.loads((state_dir / "weights.json").read_text()))


GEN = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}


async def test_a_checkpoint_plus_an_uploaded_delta_is_restored_before_ready(model_dir: Path, root: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    state_dir = root / "state-a"
    base = tiny_state_dict(7)
    step1 = write_step(root / "step_1", base)
    write_delta(root / "d2" / "delta.safetensors", base, perturb(base, 0.02, 2))
    async with serve(model_dir, root, state_dir) as (c, eng):
        assert not (state_dir / "weights.json").exists()  # nothing committed yet: nothing recorded
        r = await c.post("/update_weights", json={"weight_dir": str(step1)})
        assert r.status_code == 200 and r.json()["weight_version"] == "step_1", r.text
        rec = _record(state_dir)
        assert rec["weight_version"] == "step_1" and rec["weights"]["kind"] == "checkpoint"
        assert rec["weights"]["dir"] == str(step1.resolve()) and rec["deltas"] == []
        # A delta uploaded (multipart: tito's own copy, removed after its commit) on top.
        await prime.stage(c, root / "d2", "step_2", "step_1", "multipart")
        assert (await prime.commit(c, "step_2")).json()["active_version"] == "step_2"
        rec = _record(state_dir)
        assert rec["weight_version"] == "step_2" and rec["weights"]["dir"] == str(step1.resolve())
        [d] = rec["deltas"]
        assert d["version"] == "step_2" and d["base_version"] == "step_1"
        assert Path(d["file"]).is_file() and Path(d["file"]).is_relative_to(state_dir)
        assert Path(d["file"]).read_bytes() == (root / "d2" / "delta.safetensors").read_bytes()
        assert not any(p.name.startswith(".weights.json") for p in state_dir.iterdir())  # no temporary left
    # The same command line again: back at step_2 before the first request.
    async with serve(model_dir, root, state_dir) as (c, eng):
        assert (await c.get("/ready")).status_code == 200
        assert eng.weight_version == "step_2"
        loads = [k["files"] for n, k in eng.calls if n == "tito_load_checkpoint"]
        assert loads == [[str(step1.resolve() / "model.safetensors")]]
        assert [k["version"] for n, k in eng.calls if n == "delta_commit"] == ["step_2"]
        info = (await c.get("/server_info")).json()["state"]
        assert info["weight_version"] == "step_2"
        assert info["weight_record"]["restored"]["weight_version"] == "step_2"
        assert info["weight_record"]["restored"]["deltas"] == 1
        # Said at start and by `tito status`: which weights, from where (a surprise otherwise on a laptop).
        said = [m for r in caplog.records if r.levelname == "WARNING" and "restored from" in (m := r.getMessage())]
        assert said == [f"serving weight version step_2, restored from the weight record in {state_dir} (checkpoint "
                        f"{step1.resolve()} + 1 delta(s)), not {model_dir}'s own weights: the last version committed "
                        f"before this restart; start with --state-dir off, or remove {state_dir / 'weights.json'}, "
                        "to serve --model's weights"]
        status = format_status((await c.get("/server_info")).json())
        assert f"weights from    step_2 restored at start from {state_dir} ({step1.resolve()} + 1 delta(s))" in status
        r = await c.post("/inference/v1/generate", json=GEN)
        assert r.status_code == 200, r.text
        # /reload_weights: back to the base weights, and the record says so (the delta's copy is collected).
        assert (await c.post("/reload_weights")).status_code == 200
        rec = _record(state_dir)
        assert rec["weights"] == {"kind": "base"} and rec["weight_version"] == "default"
        assert not any((state_dir / "deltas").iterdir())


async def test_a_record_whose_files_are_gone_keeps_the_replica_not_ready(model_dir: Path, root: Path) -> None:
    state_dir = root / "state-b"
    gone = write_step(root / "step_9", tiny_state_dict(9))
    async with serve(model_dir, root, state_dir) as (c, _):
        assert (await c.post("/update_weights", json={"weight_dir": str(gone)})).status_code == 200
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()
    async with serve(model_dir, root, state_dir) as (c, eng):
        r = await c.get("/ready")
        assert r.status_code == 503 and r.json()["reason"] == "weights_not_restored"
        r = await c.post("/inference/v1/generate", json=GEN)
        assert r.status_code == 503 and "step_9" in r.text and "is gone" in r.text
        assert eng.started == 0 and eng.weight_version == "default"  # the base weights never served a request
        err = (await c.get("/server_info")).json()["state"]["weight_record"]["restore_error"]
        assert "step_9" in err
        # Weights sent on purpose end it: here the base weights, by /reload_weights.
        assert (await c.post("/reload_weights")).status_code == 200
        assert (await c.get("/ready")).status_code == 200
        assert (await c.post("/inference/v1/generate", json=GEN)).status_code == 200
    assert _record(state_dir)["weights"] == {"kind": "base"}


async def test_a_broadcast_is_recorded_as_unrestorable_and_a_rewritten_checkpoint_is_refused(
        model_dir: Path, root: Path) -> None:
    state_dir = root / "state-c"
    rec = WeightRecord(state_dir, str(model_dir))
    rec.committed("step_5", None, "broadcast")
    assert _record(state_dir)["weights"] == {"kind": "unrestorable", "source": "broadcast"}
    async with serve(model_dir, root, state_dir) as (c, _):
        r = await c.get("/ready")
        assert r.status_code == 503 and r.json()["reason"] == "weights_not_restored"
        r = await c.post("/inference/v1/generate", json=GEN)
        assert r.status_code == 503 and "broadcast" in r.text and "step_5" in r.text
    # A directory rewritten after its commit is not the committed version.
    step = write_step(root / "step_6", tiny_state_dict(6))
    async with serve(model_dir, root, state_dir) as (c, _):
        assert (await c.post("/update_weights", json={"weight_dir": str(step)})).status_code == 200
    os.utime(step / "model.safetensors", ns=(1, 1))
    async with serve(model_dir, root, state_dir) as (c, _):
        r = await c.post("/inference/v1/generate", json=GEN)
        assert r.status_code == 503 and "changed on disk" in r.text


def test_state_dir_default_and_atomic_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    d = resolve_state_dir(None, "models/tiny-qwen3", 8000)
    assert d is not None and d.parent == tmp_path / "tito" and d.name.startswith("8000-")
    assert d == resolve_state_dir(None, "models/tiny-qwen3", 8000)  # the same command line, the same record
    assert d != resolve_state_dir(None, "models/other", 8000) != resolve_state_dir(None, "models/tiny-qwen3", 8001)
    assert resolve_state_dir("off", "m", 1) is None and resolve_state_dir(None, "m", 1, default=False) is None
    assert resolve_state_dir(str(tmp_path / "x"), "m", 1) == tmp_path / "x"
    target = tmp_path / "f.json"
    write_atomic(target, b"one")
    write_atomic(target, b"two")
    assert target.read_bytes() == b"two" and [p.name for p in tmp_path.iterdir() if p.name.startswith(".f")] == []
