"""Weight integrity under faults, on the real engine: an update that fails after the model started to
change leaves the server paused and refusing work with a clear 503 ("inconsistent"), until a good update repairs it.

One server (the session's shared long-context one) for every way in: a shard read that fails after validation, a
worker exception mid-load (vLLM's own loader), a layer that loads nothing, a trainer that dies mid-broadcast, a
broadcast that times out mid-stream. The faults are injected through the worker's test-only hook
(``TITO_TEST_FAULT_FILE``, app/engine/worker.py) or a sender that misbehaves (tests/weight_sender.py). Also:
the rotary caches are bit-identical across updates, and the "RotaryEmbedding: Failed to load weights" warning is
replaced by one INFO line per update."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.tiny.model import tiny_state_dict
from tests.conftest import fault_file
from tests.helpers import ServerProcess, free_port, greedy_answer, metric_value, restore_server
from tests.rl_steps import (
    ENDLESS,
    GEN,
    PROMPTS,
    Background,
    greedy,
    reference_greedy,
    start_endless,
    update,
    write_step,
)
from tests.test_broadcast import Sender, init

pytestmark = pytest.mark.engine
MESSAGE = re.compile(r"^weights are inconsistent after a failed update \((?P<cause>.+)\); "
                     r"POST /update_weights or /reload_weights$", re.S)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("integrity")


@pytest.fixture(scope="module")
def fault(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fault_file(tmp_path_factory)


@pytest.fixture(scope="module")
def server(long_tito: ServerProcess, fault: Path) -> Iterator[ServerProcess]:
    """The shared long-context server: its worker reads the fault file, and its short liveness bound (5 s) lets the
    probes asked while a broadcast blocks all answer well within the broadcast's timeout. Put back at the end."""
    yield long_tito
    fault.unlink(missing_ok=True)
    restore_server(long_tito.url, drop_broadcaster=True)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=300.0) as c:
        yield c


@pytest.fixture(scope="module")
def fresh(client: httpx.Client) -> dict:
    """This server's answer before any update: a fresh engine on the base weights (tokens and logprobs)."""
    return greedy_answer(client)


def arm(fault: Path, spec: str) -> None:
    fault.write_text(spec)


def assert_inconsistent(client: httpx.Client, cause: str) -> None:
    r = client.post(GEN, json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 503, r.text
    m = MESSAGE.match(r.json()["error"]["message"])
    assert m and cause in m.group("cause"), r.json()
    r = client.get("/ready")
    assert r.status_code == 503 and r.json() == {"status": "not_ready", "reason": "weights_inconsistent"}
    assert metric_value(client.get("/metrics").text, "tito_weights_inconsistent") == 1.0
    st = client.get("/server_info").json()["state"]
    assert st["weights_inconsistent"] is True and cause in st["weights_inconsistent_detail"]["cause"]
    assert st["paused"] is True and st["ready"] is False
    r = client.post("/resume")
    assert r.status_code == 409 and "weights are inconsistent" in r.json()["error"]["message"], r.text
    assert client.get("/is_paused").json() == {"is_paused": True}  # never resumes by itself


def assert_consistent(client: httpx.Client) -> None:
    assert client.get("/ready").status_code == 200
    assert metric_value(client.get("/metrics").text, "tito_weights_inconsistent") == 0.0
    st = client.get("/server_info").json()["state"]
    assert st["weights_inconsistent"] is False and st["weights_inconsistent_detail"] is None


def test_read_error_after_validation_with_frozen_request(client, server, root, fault, fresh):
    """keep-paused request + a shard read that fails midway: the frozen request ends with abort, the server stays
    inconsistent; a good update repairs it and the caller's /resume then serves the new weights."""
    bg = start_endless(client, server.url, "frozen-read-fault")
    assert client.post("/pause", params={"mode": "keep"}).status_code == 200
    arm(fault, "read:5")
    r = update(client, write_step(root / "run" / "step_1", tiny_state_dict(11)))
    assert r.status_code == 500, r.text
    assert "Input/output error (injected)" in r.json()["error"]["message"]
    choice = bg.result()["choices"][0]  # type: ignore[index]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < ENDLESS
    assert_inconsistent(client, "Input/output error (injected)")
    assert not fault.exists()  # the hook fired once
    sd = tiny_state_dict(12)
    r = update(client, write_step(root / "run" / "step_2", sd))
    assert r.status_code == 200 and r.json()["weight_version"] == "step_2", r.text
    assert_consistent(client)
    assert client.get("/is_paused").json() == {"is_paused": True}  # the caller paused: the caller resumes
    assert client.post("/resume").json() == {"status": "resumed"}
    assert greedy(client) == reference_greedy(sd, root / "ref-12", PROMPTS, 8)
    assert "weights are INCONSISTENT after a failed disk update" in server.log_text()


def test_worker_raises_mid_load_then_reload_repairs(client, server, root, fault, fresh):
    """Not paused by the caller: the update pauses itself; vLLM's loader raises on a wrong-shaped tensor midway. The
    server stays paused; /reload_weights repairs it and resumes (the failed update had paused), and the answers
    equal this server's own when it was fresh on the base weights."""
    arm(fault, "shape:7")
    r = update(client, write_step(root / "run" / "step_3", tiny_state_dict(13)))
    assert r.status_code == 500, r.text
    assert_inconsistent(client, "loading weights from")
    r = client.post("/reload_weights")
    assert r.status_code == 200 and r.json()["weight_version"] == "default", r.text
    assert_consistent(client)
    assert client.get("/is_paused").json() == {"is_paused": False}
    again = greedy_answer(client)
    assert again["tokens"] == fresh["tokens"]
    assert again["logprobs"] == pytest.approx(fresh["logprobs"], abs=1e-5)


def test_a_layer_that_loads_nothing_fails_the_update(client, server, root, fault):
    """The other half: a real "Failed to load weights" (a layer the checkpoint covers loaded nothing) stays
    an error and fails the update."""
    arm(fault, "skip:model.norm.weight")
    r = update(client, write_step(root / "run" / "step_4", tiny_state_dict(14)))
    assert r.status_code == 500, r.text
    assert "layer(s) failed to load: RMSNorm: nothing loaded" in r.json()["error"]["message"]
    assert_inconsistent(client, "RMSNorm: nothing loaded")
    sd = tiny_state_dict(15)
    assert update(client, write_step(root / "run" / "step_5", sd)).status_code == 200
    assert_consistent(client)
    assert greedy(client) == reference_greedy(sd, root / "ref-15", PROMPTS, 8)
    assert "RMSNorm: Failed to load weights" in server.log_text()  # the real failure is still logged


def test_trainer_dies_mid_broadcast(client, server, root):
    port = free_port()
    d = root / "die" / "step_6"
    sender = Sender(port, [(d, 16)], mode="die", after=2)  # embeddings + layer 0 of 3 state dicts, then exits
    try:
        assert init(client, port).status_code == 200
        (d / "NCCL_READY").touch()
        r = client.post("/update_weights", json={"weight_dir": str(d), "timeout": 120})
        assert r.status_code == 504, r.text
        assert "receive of" in r.json()["error"]["message"]
        assert "sent 2 of 3 state dicts" in sender.finish()
    finally:
        sender.kill()
    assert_inconsistent(client, "receiving the weight broadcast")
    sd = tiny_state_dict(17)
    assert update(client, write_step(root / "run" / "step_7", sd)).status_code == 200
    assert_consistent(client)
    assert greedy(client) == reference_greedy(sd, root / "ref-17", PROMPTS, 8)


def test_broadcast_timeout_mid_stream_and_probes_stay_live(client, server, root):
    """The trainer stalls after one state dict: while the worker blocks in the receive, /metrics, /liveness and
    /server_info still answer (each bounds its engine call: 2 s, 5 s, --liveness-timeout 5 s: 12 s at most, well
    within the receive's 30 s timeout); the timeout leaves the server inconsistent; a good broadcast from a new group
    repairs it."""
    port = free_port()
    d = root / "stall" / "step_8"
    sender = Sender(port, [(d, 18)], mode="stall-after", after=1)
    try:
        assert init(client, port).status_code == 200
        (d / "NCCL_READY").touch()
        upd = Background(client.post, "/update_weights", json={"weight_dir": str(d), "timeout": 30})
        deadline = time.monotonic() + 60
        while "sent 1 of 3" not in (sender.proc.stdout.readline() if sender.proc.stdout else ""):
            assert time.monotonic() < deadline
        for path in ("/metrics", "/server_info", "/liveness", "/health"):
            r = client.get(path, timeout=60)
            assert r.status_code in (200, 503), (path, r.text)
            assert not upd.done(), f"{path} answered only after the broadcast had ended"
        r = upd.result(timeout=120)
        assert r.status_code == 504 and "timed out after 30s" in r.json()["error"]["message"], r.text  # type: ignore
    finally:
        sender.kill()
    assert_inconsistent(client, "receiving the weight broadcast")
    port = free_port()
    d2 = root / "good" / "step_9"
    sender = Sender(port, [(d2, 19)])
    try:
        assert init(client, port).status_code == 200
        (d2 / "NCCL_READY").touch()
        r = client.post("/update_weights", json={"weight_dir": str(d2)})
        assert r.status_code == 200 and r.json()["source"] == "broadcast", r.text
    finally:
        sender.kill()
    assert_consistent(client)
    assert client.get("/is_paused").json() == {"is_paused": False}
    assert greedy(client) == reference_greedy(tiny_state_dict(19), root / "ref-19", PROMPTS, 8)


def test_rotary_caches_bit_identical_and_one_info_line(client, server, root, fresh):
    """Every reload keeps the rotary cache bit for bit (the worker hashes the named buffers before and
    after), the warning is gone, one INFO line per update says what was kept, and output equals the fresh engine."""
    n0 = server.log_text().count("kept as is")
    assert client.post("/reload_weights").status_code == 200
    sd = tiny_state_dict(20)
    assert update(client, write_step(root / "run" / "step_10", sd)).status_code == 200
    assert greedy(client) == reference_greedy(sd, root / "ref-20", PROMPTS, 8)
    assert client.post("/reload_weights").status_code == 200
    again = greedy_answer(client)
    assert again["tokens"] == fresh["tokens"] and again["logprobs"] == pytest.approx(fresh["logprobs"], abs=1e-5)
    log = server.log_text()
    lines = re.findall(r"kept as is \(non-checkpoint buffers only\): (.+?); rotary caches bit-identical before "
                       r"and after \((\w+)\)", log)
    assert len(lines) - n0 >= 3 and all(kept == "1 RotaryEmbedding" for kept, _ in lines), lines
    assert len({digest for _, digest in lines}) == 1  # the same cache across every update of this server
    assert "RotaryEmbedding: Failed to load weights" not in log
    assert "rotary caches CHANGED" not in log
