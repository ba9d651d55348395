"""Fast tests of the staged-update routes on a fake engine (tests/fake_engine.py): Prime-RL's field handling over
the four transports, retries, chunk assembly, sha256 and size checks, version rules, commit semantics, limits.
The real-engine test (tests/test_staged_weights.py) is the evidence that a commit applies the weights exactly."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.protocol import ApiError
from app.core.settings import Settings
from app.tiny.model import make_tiny_model, tiny_state_dict
from tests import prime_stage_client as prime
from tests.delta_encoder import BAD_DELTAS, perturb, write_delta
from tests.fake_engine import FakeEngine
from tito.main import create_app


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("staging")


@pytest.fixture(scope="module")
def model_dir(root: Path) -> Path:
    return make_tiny_model(root / "tiny", tokenizer=False)


@pytest.fixture(scope="module")
def steps(root: Path) -> dict[str, Path]:
    """Two chained deltas (base -> 1 -> 2) in both containers, as a trainer writes step directories."""
    base = tiny_state_dict()
    one = perturb(base, 0.02, 1)
    two = perturb(one, 0.02, 2)
    out = {}
    for name, (a, b) in {"step_1": (base, one), "step_2": (one, two)}.items():
        write_delta(root / name / "delta.safetensors", a, b)
        write_delta(root / name / "delta.stream", a, b)
        (root / name / ".finished").touch()
        out[name] = root / name
    return out


@asynccontextmanager
async def serve(model_dir: Path, root: Path, engine: FakeEngine | None = None,
                **settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, FakeEngine]]:
    engine = engine or FakeEngine()
    s = Settings.build(env={}, model=str(model_dir), warmup=False, allowed_weight_root=[str(root)],
                       staging_dir=str(root), **settings)
    app = create_app(s, engine=engine)  # type: ignore[arg-type]
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tito",
                                     timeout=30) as c:
            yield c, engine


def _calls(eng: FakeEngine, name: str) -> list[Any]:
    return [kw for n, kw in eng.calls if n == name]


async def _applying(eng: FakeEngine, n: int, timeout: float = 10.0) -> None:
    """Wait until the ``n``-th commit has reached the engine (it then holds at the cleared ``commit_gate``)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while len(_calls(eng, "delta_commit")) < n:
        assert asyncio.get_running_loop().time() < deadline, eng.calls
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("transport", prime.TRANSPORTS)
async def test_prime_sequence_over_each_transport(model_dir: Path, root: Path, steps: dict[str, Path],
                                                  transport: str) -> None:
    async with serve(model_dir, root) as (c, eng):
        assert (await c.get("/weight_status")).json()["active_version"] == "base"
        staged = await prime.stage(c, steps["step_1"], "1", "base", transport, chunk_size=8192)
        assert staged["status"] == "ok" and staged["version"] == "1" and staged["tensors"] > 20
        art = prime.artifact(steps["step_1"], transport)
        assert staged["sha256"] == hashlib.sha256(art.read_bytes()).hexdigest()
        # The workers were asked to fill their copy of the base from the model's own checkpoint.
        assert _calls(eng, "delta_prepare")[-1]["version"] == "base"
        assert _calls(eng, "delta_prepare")[-1]["files"] == [str(model_dir / "model.safetensors")]
        # ... and to make the staged delta ready for its commit, from tito's prepared form of it.
        ahead = _calls(eng, "delta_prepare")[-1]["delta"]
        assert ahead["version"] == "1" and ahead["path"].endswith("prepared.stream"), ahead
        r = await prime.commit(c, "1")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "ok" and r.json()["active_version"] == "1" and r.json()["mode"] == "delta"
        assert _calls(eng, "delta_commit")[-1]["base"] == "base"
        # Chained: the next delta builds on "1", from the workers' copy (no files).
        await prime.stage(c, steps["step_2"], "2", "1", transport, chunk_size=8192)
        assert {k: v for k, v in _calls(eng, "delta_prepare")[-1].items() if k != "delta"} == \
            {"version": "1", "files": None}
        assert (await prime.commit(c, "2")).json()["active_version"] == "2"
        status = (await c.get("/weight_status")).json()
        assert status["active_version"] == "2" and status["weights_dirty"] is False and status["staged"] == []
        assert status["active_sha256"] == hashlib.sha256(
            prime.artifact(steps["step_2"], transport).read_bytes()).hexdigest()
        assert eng.weight_version == "2" and (await c.get("/is_paused")).json() == {"is_paused": False}
        info = (await c.get("/server_info")).json()["state"]
        assert info["weight_version"] == "2" and info["staging"]["active_version"] == "2"
        metrics = (await c.get("/metrics")).text
        assert f'tito_stages_total{{mode="delta",outcome="ok",transport="{transport}"}}' in metrics
        assert 'tito_weight_updates_total{outcome="ok",source="delta"}' in metrics
        # /reload_weights (form-encoded, as Prime's client sends it) goes back to "base".
        r = await c.post("/reload_weights", data={"resume": "false"})
        assert r.status_code == 200, r.text
        assert (await c.get("/weight_status")).json()["active_version"] == "base"


async def test_version_rules(model_dir: Path, root: Path, steps: dict[str, Path]) -> None:
    path = steps["step_1"].as_posix()
    async with serve(model_dir, root) as (c, eng):
        async def stage(**fields: str) -> httpx.Response:
            return await c.post("/stage", data={"path": path, **fields})

        assert (await stage(mode="delta", base_version="base")).status_code == 400  # no version
        assert (await stage(version="1", mode="sideways", base_version="base")).status_code == 400
        assert (await stage(version="1", mode="delta")).status_code == 400  # no base_version
        r = await stage(version="1", mode="delta", base_version="7")
        assert r.status_code == 409 and "base_version mismatch" in r.text
        assert (await stage(version="base", mode="delta", base_version="base")).status_code == 409
        # tito's own label for the base weights is accepted as their name too.
        assert (await stage(version="1", mode="delta", base_version="default")).status_code == 200
        assert (await c.post("/stage", data={"version": "1", "mode": "delta", "base_version": "base",
                                            "path": str(root / "nope")})).status_code == 404
        assert (await c.post("/stage", data={"version": "1", "mode": "delta", "base_version": "base",
                                            "path": "/etc"})).status_code == 403
        assert (await c.post("/stage", data={"version": "1", "mode": "delta", "base_version": "base"})).status_code \
            == 400
        # Commit rules: unknown version 404, other mode 409; committing the active version is a no-op 200.
        assert (await c.post("/commit", data={"version": "9", "mode": "delta"})).status_code == 404
        assert (await c.post("/commit", data={"version": "1", "mode": "full"})).status_code == 409
        assert (await c.post("/commit", data={"version": "1", "mode": "odd"})).status_code == 400
        assert (await c.post("/commit", data={"version": "1", "mode": "delta"})).status_code == 200
        r = await c.post("/commit", data={"version": "1", "mode": "delta"})
        assert r.status_code == 200 and r.json()["noop"] is True
        assert len(_calls(eng, "delta_commit")) == 1
        # A staged delta whose base is no longer active: 409 at commit.
        await c.post("/stage", data={"version": "2", "mode": "delta", "base_version": "1",
                                    "path": steps["step_2"].as_posix()})
        await c.post("/reload_weights")
        r = await c.post("/commit", data={"version": "2", "mode": "delta"})
        assert r.status_code == 409 and "base_version mismatch" in r.text


async def test_bad_delta_is_a_400_at_stage_time(model_dir: Path, root: Path) -> None:
    base = tiny_state_dict()
    async with serve(model_dir, root) as (c, eng):
        for i, (case, (b_change, t_change)) in enumerate(BAD_DELTAS.items()):
            b, t = {**base, **b_change}, {**perturb(base, 0.05, 9), **t_change}
            d = write_delta(root / f"bad{i}" / "delta.safetensors", b, t)
            r = await c.post("/stage", data={"version": "v", "mode": "delta", "base_version": "base",
                                            "path": str(d)})
            assert r.status_code == 400, (case, r.text)
            assert r.json()["error"]["param"] == "path"
        (root / "bad-garbage").mkdir(exist_ok=True)
        (root / "bad-garbage" / "delta.stream").write_bytes(b"PDELSTRM\x02\x00\x00\x00garbage")
        r = await c.post("/stage", data={"version": "v", "mode": "delta", "base_version": "base",
                                        "path": str(root / "bad-garbage")})
        assert r.status_code == 400 and "truncated" in r.text
        r = await c.post("/stage", data={"version": "v", "mode": "delta", "base_version": "base"},
                         files={"file": ("delta.safetensors", b"not a delta", "application/octet-stream")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "file"
        assert (await c.get("/weight_status")).json()["staged"] == [] and not _calls(eng, "delta_commit")
        # An empty delta is valid (the start-up marker of Prime's trainer).
        e = write_delta(root / "empty" / "delta.safetensors", base, base)
        r = await c.post("/stage", data={"version": "0", "mode": "delta", "base_version": "base", "path": str(e)})
        assert r.status_code == 200 and r.json()["tensors"] == 0
        assert (await c.post("/commit", data={"version": "0", "mode": "delta"})).json()["active_version"] == "0"


async def test_chunked_upload_retries_sha_and_completeness(model_dir: Path, root: Path,
                                                           steps: dict[str, Path]) -> None:
    raw = (steps["step_1"] / "delta.safetensors").read_bytes()
    sha = hashlib.sha256(raw).hexdigest()
    fields = {"version": "1", "mode": "delta", "base_version": "base", "filename": "delta.safetensors",
              "total_size": str(len(raw)), "sha256": sha}
    half = len(raw) // 2

    async def chunk(c: httpx.AsyncClient, off: int, part: bytes, **extra: str) -> httpx.Response:
        return await c.post("/stage_chunk", data={**fields, **extra, "offset": str(off)},
                            files={"file": ("delta.safetensors", part, "application/octet-stream")})

    async with serve(model_dir, root) as (c, eng):
        assert (await chunk(c, half, raw[half:])).status_code == 200  # second half first
        r = await c.post("/stage_finalize", data=fields)
        assert r.status_code == 409 and "incomplete" in r.text  # the client never sent the first half
        assert (await chunk(c, 0, raw[:half])).status_code == 200
        assert (await chunk(c, 0, raw[:half])).status_code == 200  # a retried chunk: same bytes, same place
        first = await c.post("/stage_finalize", data=fields)
        assert first.status_code == 200, first.text
        again = await c.post("/stage_finalize", data=fields)  # a retried finalize returns the stored answer
        assert again.json() == first.json()
        late = await chunk(c, 0, raw[:half])  # a chunk retried after finalize: acknowledged, nothing changes
        assert late.status_code == 200 and late.json()["finalized"] is True
        # sha256 mismatch: 409 and the upload is discarded (a finalize retry finds nothing).
        bad = {**fields, "version": "1b", "sha256": "0" * 64}
        r = await c.post("/stage_chunk", data={**bad, "offset": "0"},
                         files={"file": ("delta.safetensors", raw, "application/octet-stream")})
        assert r.status_code == 200
        r = await c.post("/stage_finalize", data=bad)
        assert r.status_code == 409 and "sha256 mismatch" in r.text
        assert (await c.post("/stage_finalize", data=bad)).status_code == 404
        # Bounds: over --max-stage-bytes is a 413.
        assert (await chunk(c, 0, b"x", total_size=str(2**50))).status_code == 413
        assert [s["version"] for s in (await c.get("/weight_status")).json()["staged"]] == ["1"]


async def test_streaming_upload_init_and_finalize_are_idempotent(model_dir: Path, root: Path,
                                                                 steps: dict[str, Path]) -> None:
    raw = (steps["step_1"] / "delta.stream").read_bytes()
    sha = hashlib.sha256(raw).hexdigest()
    init = {"version": "1", "mode": "delta", "base_version": "base", "filename": "delta.stream", "upload_id": "u1"}
    async with serve(model_dir, root) as (c, _):
        r = await c.post("/stage_stream_init", json=init)
        assert r.json()["upload_id"] == "u1" and r.json()["finalized"] is False
        assert (await c.post("/stage_stream_init", json=init)).json()["finalized"] is False  # retried init
        cut = len(raw) // 3
        for off in (cut, 0, cut):  # out of order, once twice
            part = raw[off:off + cut] if off == 0 else raw[off:]
            r = await c.post("/stage_stream_chunk", params={"upload_id": "u1", "chunk_index": 0, "offset": off},
                             content=part)
            assert r.status_code == 200, r.text
        fin = {"upload_id": "u1", "final_size": str(len(raw)), "sha256": sha}
        first = await c.post("/stage_stream_finalize", data=fin)
        assert first.status_code == 200, first.text
        assert (await c.post("/stage_stream_finalize", data=fin)).json() == first.json()
        assert (await c.post("/stage_stream_init", json=init)).json()["finalized"] is True
        r = await c.post("/stage_stream_chunk", params={"upload_id": "nope", "offset": 0}, content=b"x")
        assert r.status_code == 404
        r = await c.post("/stage_stream_init", json={**init, "upload_id": "u2", "mode": "full"})
        assert r.status_code == 400
        # The same upload_id with other fields is a conflict.
        r = await c.post("/stage_stream_init", json={**init, "upload_id": "u3"})
        r = await c.post("/stage_stream_init", json={**init, "upload_id": "u3", "version": "other"})
        assert r.status_code == 409


async def test_concurrent_commits_apply_once_and_a_failed_apply_is_dirty(model_dir: Path, root: Path,
                                                                         steps: dict[str, Path]) -> None:
    async with serve(model_dir, root, engine=FakeEngine(delta_delay=0.2)) as (c, eng):
        await prime.stage(c, steps["step_1"], "1", "base", "path")
        rs = await asyncio.gather(*(c.post("/commit", data={"version": "1", "mode": "delta"}) for _ in range(3)))
        assert [r.status_code for r in rs] == [200] * 3 and len(_calls(eng, "delta_commit")) == 1
        # A commit is a weight update: a disk update meanwhile is refused.
        await prime.stage(c, steps["step_2"], "2", "1", "path")
        eng.commit_gate.clear()  # the commit holds in its apply until the disk update has been refused
        commit = asyncio.ensure_future(c.post("/commit", data={"version": "2", "mode": "delta"}))
        await _applying(eng, 2)
        r = await c.post("/update_weights", json={"weight_dir": str(model_dir)})
        assert r.status_code == 409, r.text
        eng.commit_gate.set()
        assert (await commit).status_code == 200
        # An apply that fails after the model started to change: 500, dirty; stage and resume 409 until a reload.
        d = write_delta(root / "step_3" / "delta.safetensors", tiny_state_dict(), perturb(tiny_state_dict(), .01, 3))
        await c.post("/reload_weights")
        await prime.stage(c, d.parent, "3", "base", "path")
        eng.delta_fail = RuntimeError("worker died halfway")
        r = await prime.commit(c, "3")
        assert r.status_code == 500, r.text
        status = (await c.get("/weight_status")).json()
        assert status["weights_dirty"] is True and status["active_version"] == "base"
        assert (await c.post("/resume")).status_code == 409
        r = await c.post("/stage", data={"version": "4", "mode": "delta", "base_version": "base", "path": str(d)})
        assert r.status_code == 409
        assert (await c.post("/reload_weights")).status_code == 200
        assert (await c.get("/weight_status")).json()["weights_dirty"] is False
        assert (await c.post("/resume")).status_code == 200


async def test_bounded_staging(model_dir: Path, root: Path, steps: dict[str, Path]) -> None:
    async with serve(model_dir, root, max_staged_versions=2, max_stage_bytes=4096) as (c, _):
        for v in ("a", "b", "c"):
            r = await c.post("/stage", data={"version": v, "mode": "delta", "base_version": "base",
                                            "path": steps["step_1"].as_posix()})
            assert r.status_code == 200, r.text
        assert [s["version"] for s in (await c.get("/weight_status")).json()["staged"]] == ["b", "c"]
        big = (steps["step_1"] / "delta.safetensors").read_bytes()
        for extra in (b"", b"\0" * 70000):  # over the limit: refused after reading, or at once (Content-Length)
            r = await c.post("/stage", data={"version": "d", "mode": "delta", "base_version": "base"},
                             files={"file": ("delta.safetensors", big + extra, "application/octet-stream")})
            assert r.status_code == 413, r.text
        # Staging the same version again replaces it.
        r = await c.post("/stage", data={"version": "c", "mode": "delta", "base_version": "base",
                                        "path": steps["step_1"].as_posix()})
        assert [s["version"] for s in (await c.get("/weight_status")).json()["staged"]] == ["b", "c"]
        dirs = list((Path(json.loads((await c.get("/server_info")).text)["state"]["staging"]["directory"])
                     / "versions").iterdir())
        assert len(dirs) == 2  # dropped versions leave nothing on disk


async def test_full_mode_stage_and_commit(model_dir: Path, root: Path) -> None:
    async with serve(model_dir, root) as (c, eng):
        raw = (model_dir / "model.safetensors").read_bytes()
        r = await c.post("/stage", data={"version": "f1", "mode": "full"},
                         files={"file": ("step-7.safetensors", raw, "application/octet-stream")})
        assert r.status_code == 200, r.text
        r = await c.post("/commit", data={"version": "f1"})
        assert r.status_code == 200 and r.json()["mode"] == "full", r.text
        assert _calls(eng, "tito_load_checkpoint") and eng.weight_version == "f1"
        assert (await c.get("/weight_status")).json()["active_version"] == "f1"
        # A delta on top of a committed full version fills the workers' copy from its staged files.
        d = write_delta(root / "on-full" / "delta.safetensors", tiny_state_dict(), perturb(tiny_state_dict(), .01, 4))
        r = await c.post("/stage", data={"version": "f2", "mode": "delta", "base_version": "f1", "path": str(d)})
        assert r.status_code == 200, r.text
        assert _calls(eng, "delta_prepare")[-1]["version"] == "f1" and _calls(eng, "delta_prepare")[-1]["files"]


async def test_a_delta_needs_the_active_checkpoint_or_a_copy(model_dir: Path, root: Path) -> None:
    """After a full update the workers' copy is filled from that checkpoint: gone from disk, a delta is a 409 (Prime
    then falls back to a full reload). After a broadcast there is no checkpoint at all: 409 as well."""
    import shutil

    ck = root / "gone-step"
    ck.mkdir(exist_ok=True)
    shutil.copy(model_dir / "model.safetensors", ck / "model.safetensors")
    d = write_delta(root / "on-gone" / "delta.safetensors", tiny_state_dict(), perturb(tiny_state_dict(), .01, 5))
    async with serve(model_dir, root) as (c, _):
        assert (await c.post("/update_weights", json={"weight_dir": str(ck), "weight_version": "s1"})).status_code \
            == 200
        shutil.rmtree(ck)
        r = await c.post("/stage", data={"version": "s2", "mode": "delta", "base_version": "s1", "path": str(d)})
        assert r.status_code == 409 and "no longer readable" in r.text, r.text
        app_state = c._transport.app.state.tito  # type: ignore[attr-defined]
        app_state.weights.origin = None  # what a broadcast or vLLM's native transfer leaves
        r = await c.post("/stage", data={"version": "s2", "mode": "delta", "base_version": "s1", "path": str(d)})
        assert r.status_code == 409 and "broadcast" in r.text, r.text


async def test_commit_and_vllms_native_transfer_are_one_update_at_a_time(model_dir: Path, root: Path,
                                                                       steps: dict[str, Path]) -> None:
    """vLLM's native transfer (HTTP /start_weight_update .. /finish_weight_update and vllm.Control's
    StartWeightUpdate .. FinishWeightUpdate over gRPC both run as ``WeightManager.native``) and a commit exclude each
    other; a native update leaves the weights where no staged delta's base is."""
    async with serve(model_dir, root, engine=FakeEngine(delta_delay=0.2)) as (c, eng):
        native = c._transport.app.state.tito.weights.native  # type: ignore[attr-defined]
        await prime.stage(c, steps["step_1"], "1", "base", "path")
        await native("start", eng.start_weight_update)
        r = await c.post("/commit", data={"version": "1", "mode": "delta"})
        assert r.status_code == 409 and "native weight update" in r.text, r.text
        assert [s["version"] for s in (await c.get("/weight_status")).json()["staged"]] == ["1"]
        await native("finish", lambda: eng.finish_weight_update("n1"), "n1")
        r = await c.post("/commit", data={"version": "1", "mode": "delta"})
        assert r.status_code == 409 and "base_version mismatch" in r.text, r.text
        assert not _calls(eng, "delta_commit")
        assert (await c.get("/weight_status")).json()["active_version"] == "n1"
        # A native start while a commit applies: 409, the commit completes.
        assert (await c.post("/reload_weights")).status_code == 200
        await prime.stage(c, steps["step_1"], "1", "base", "path")
        eng.commit_gate.clear()
        commit = asyncio.ensure_future(c.post("/commit", data={"version": "1", "mode": "delta"}))
        await _applying(eng, 1)
        with pytest.raises(ApiError) as e:
            await native("start", eng.start_weight_update)
        assert e.value.status == 409
        eng.commit_gate.set()
        assert (await commit).status_code == 200 and eng.weight_version == "1"


async def test_stage_timeout_bounds_the_check_and_the_apply(model_dir: Path, root: Path,
                                                            steps: dict[str, Path]) -> None:
    """``--stage-timeout`` bounds a delta's check (the staging process is killed: 504, which Prime's client retries;
    the next stage starts another process) and a commit's apply in the workers (504; the workers may have changed
    some weights, so they are inconsistent until /reload_weights)."""
    stage = {"version": "1", "mode": "delta", "base_version": "base", "path": steps["step_1"].as_posix()}
    async with serve(model_dir, root, engine=FakeEngine(delta_delay=2.0), stage_timeout=0.001) as (c, eng):
        mgr = c._transport.app.state.tito.staging  # type: ignore[attr-defined]
        r = await c.post("/stage", data=stage)
        assert r.status_code == 504 and "--stage-timeout" in r.text, r.text
        assert (await c.get("/weight_status")).json()["staged"] == []
        mgr.settings = dataclasses.replace(mgr.settings, stage_timeout=120.0)
        assert (await c.post("/stage", data=stage)).status_code == 200
        mgr.settings = dataclasses.replace(mgr.settings, stage_timeout=0.1)
        r = await prime.commit(c, "1")
        assert r.status_code == 504, r.text
        assert (await c.get("/weight_status")).json()["weights_dirty"] is True
        assert (await c.post("/reload_weights")).status_code == 200
        assert (await c.get("/weight_status")).json()["weights_dirty"] is False


async def test_a_delta_stage_answers_once_the_workers_made_it_ready(model_dir: Path, root: Path,
                                                                   steps: dict[str, Path]) -> None:
    """The stage answer waits for the workers' preparation (Prime-RL commits as soon as it answers), bounded by
    --stage-ready-wait: past it the answer says not ready and the version is staged all the same."""
    async with serve(model_dir, root, engine=FakeEngine(delta_ready_after=3)) as (c, eng):
        r = await c.post("/stage", data={"version": "1", "mode": "delta", "base_version": "base",
                                         "path": str(steps["step_1"])})
        assert r.status_code == 200 and r.json()["ready"] is True, r.text
        assert eng._pending is not None and eng._pending["looks"] == 0  # it looked until the workers were ready
    async with serve(model_dir, root, engine=FakeEngine(delta_ready_after=10**9), stage_ready_wait=0.3) as (c, eng):
        t0 = asyncio.get_running_loop().time()
        r = await c.post("/stage", data={"version": "1", "mode": "delta", "base_version": "base",
                                         "path": str(steps["step_1"])})
        waited = asyncio.get_running_loop().time() - t0
        assert r.status_code == 200 and r.json()["ready"] is False and 0.3 <= waited < 10, (r.text, waited)
        assert [e["version"] for e in (await c.get("/weight_status")).json()["staged"]] == ["1"]
        assert (await prime.commit(c, "1")).json()["active_version"] == "1"
