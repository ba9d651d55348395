"""Prime-RL's broadcast weight update (prime-rl-contract.md §2b) end to end over gloo: a trainer-side sender
subprocess (tests/weight_sender.py) is rank 0, tito's worker joins, receives, validates and loads."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from app.tiny.model import tiny_state_dict
from tests.helpers import ROOT, engine_env, free_port
from tests.rl_steps import PROMPTS, Background, greedy, reference_greedy, weight_module_fixtures

pytestmark = pytest.mark.engine


class Sender:
    """The trainer: ``python -m tests.weight_sender`` in its own process (rank 0, hosts the TCPStore)."""

    def __init__(self, port: int, steps: list[tuple[Path, int]], mode: str = "ok", timeout: float = 300.0,
                 after: int = 2, tied: bool = False) -> None:
        self.port = port
        cmd = [sys.executable, "-m", "tests.weight_sender", "--port", str(port), "--world-size", "2",
               "--mode", mode, "--timeout", str(timeout), "--after", str(after), *(["--tied"] if tied else [])]
        for d, seed in steps:
            d.mkdir(parents=True, exist_ok=True)
            cmd += ["--step-dir", str(d), "--seed", str(seed)]
        self.proc = subprocess.Popen(cmd, cwd=str(ROOT), env=engine_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)

    def finish(self, timeout: float = 120.0) -> str:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()

    def wait_listening(self, timeout: float = 240.0) -> None:
        """Wait until the sender's TCPStore accepts connections (it imports torch and vLLM first: tens of seconds on
        a busy machine), so a join can then be given a short timeout. A connection to itself (TCP self-connect on a
        port nobody listens on yet) does not count."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.finish()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2.0) as sock:
                    if sock.getsockname() != sock.getpeername():
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, "the sender never listened"
            time.sleep(0.1)


root, server, client = weight_module_fixtures("bcast", timeout=300.0)  # the long-context server, put back at the end


def init(client: httpx.Client, port: int, **kw: object) -> httpx.Response:
    # The sender is a fresh process importing torch and vLLM before it hosts the store: on a busy 2-core machine that
    # alone can take tens of seconds, so the join gets a generous timeout.
    body = {"host": "127.0.0.1", "port": port, "rank_offset": 0, "inference_world_size": 1, "timeout": 240,
            "quantize_in_weight_transfer": False, **kw}
    return client.post("/init_broadcaster", json=body)


def test_broadcast_updates_match_the_sent_weights(client, root):
    port = free_port()
    s1, s2 = root / "run" / "step_1", root / "run" / "step_2"
    sender = Sender(port, [(s1, 31), (s2, 32)])
    try:
        r = init(client, port)
        assert r.status_code == 200, r.text
        assert r.json()["ranks"] == [1] and r.json()["backend"] == "gloo" and r.json()["world_size"] == 2
        base = greedy(client)
        for step_dir, seed, body in ((s1, 31, {"weight_dir": str(s1)}),
                                     (s2, 32, {"weight_dir": None, "weight_version": "bcast-2"})):
            assert client.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
            try:
                (step_dir / "NCCL_READY").touch()  # the orchestrator's signal to the trainer
                r = client.post("/update_weights", json=body)
                assert r.status_code == 200, r.text
            finally:
                assert client.post("/resume").json() == {"status": "resumed"}
            out = r.json()
            assert out["source"] == "broadcast" and out["noop"] is False
            assert 0 < out["reload_seconds"] < out["seconds"]
            assert out["weight_version"] == ("step_1" if seed == 31 else "bcast-2")
            # 18 model tensors in fp32 plus the two float64 rotary buffers (sent, then skipped).
            assert out["bytes"] == sum(v.numel() * 4 for v in tiny_state_dict(seed).values()) + 32 * 8
            want = reference_greedy(tiny_state_dict(seed), root / f"ref-{seed}", PROMPTS, 8)
            got = greedy(client)
            assert got == want and got != base
            if seed == 31:
                # Prime-RL retries on timeout/5xx: the same step again must not start a second (hanging) receive.
                again = client.post("/update_weights", json=body, timeout=30)
                assert again.status_code == 200 and again.json()["noop"] is True
        assert "sent step_2" in sender.finish()
    finally:
        sender.kill()


def test_receive_timeout_fails_cleanly_and_model_is_untouched(client, root):
    port = free_port()
    d = root / "stall" / "step_9"
    sender = Sender(port, [(d, 0)], mode="stall")
    try:
        # A short group timeout (init's): were the worker to wait for the abandoned receive (the stalled trainer keeps
        # the group open), it would wait that long, not the join's default 240 s. The sender is listening first, so
        # the join needs nothing like 30 s.
        sender.wait_listening()
        assert init(client, port, timeout=30).status_code == 200
        before = greedy(client)
        (d / "NCCL_READY").touch()
        t0 = time.monotonic()
        r = client.post("/update_weights", json={"weight_dir": str(d), "timeout": 3})
        assert r.status_code == 504, r.text
        assert time.monotonic() - t0 < 30
        msg = r.json()["error"]["message"]
        assert "timed out after 3s" in msg and "/init_broadcaster" in msg
        t1 = time.monotonic()
        assert greedy(client) == before
        # At once: the worker does not wait out the abandoned receive (until the group's own 30 s timeout).
        assert time.monotonic() - t1 < 20
        assert client.get("/is_paused").json() == {"is_paused": False}
        # The broken group was dropped: the next broadcast update says so instead of hanging.
        r = client.post("/update_weights", json={"weight_dir": None})
        assert r.status_code == 400 and "no broadcaster" in r.json()["error"]["message"]
    finally:
        sender.kill()


def test_malicious_metadata_pickle_is_refused(client, root):
    port = free_port()
    d = root / "evil" / "step_1"
    sender = Sender(port, [(d, 0)], mode="evil")
    try:
        assert init(client, port).status_code == 200
        before = greedy(client)
        (d / "NCCL_READY").touch()
        r = client.post("/update_weights", json={"weight_dir": str(d), "timeout": 20})
        assert r.status_code == 400, r.text
        assert "refusing to unpickle global posix.system" in r.json()["error"]["message"]
        assert greedy(client) == before
    finally:
        sender.kill()


def test_init_broadcaster_errors(client):
    # This server has one worker: rank_offset 1 needs inference_world_size >= 2.
    r = init(client, free_port(), rank_offset=1, inference_world_size=1)
    assert r.status_code == 400, r.text
    assert "inference_world_size must be at least rank_offset + 1" in r.json()["error"]["message"]
    # Nobody hosts the store: a clear timeout, not a hang.
    t0 = time.monotonic()
    r = init(client, free_port(), timeout=3)
    assert r.status_code == 504, r.text
    assert "could not join the trainer's gloo group" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 60
    assert init(client, free_port(), quantize_in_weight_transfer=True).status_code == 501
    assert init(client, free_port(), backend="nccl").status_code == 501
    # The engine still serves.
    assert len(greedy(client)[0]) == 8


def test_init_broadcaster_survives_a_client_disconnect(client, root, server):
    """The trainer joins late and the HTTP caller gives up first: the join still completes on the server."""
    port = free_port()
    d = root / "late" / "step_3"
    with pytest.raises(httpx.ReadTimeout):
        client.post("/init_broadcaster", json={"host": "127.0.0.1", "port": port, "inference_world_size": 1,
                                               "timeout": 240}, timeout=1.0)
    sender = Sender(port, [(d, 41)])
    try:
        deadline = time.monotonic() + 240
        while f"broadcaster ready: 127.0.0.1:{port}" not in server.log_text():
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.2)
        (d / "NCCL_READY").touch()
        up = Background(client.post, "/update_weights", json={"weight_dir": str(d)})
        r = up.result()
        assert r.status_code == 200, r.text  # type: ignore[union-attr]
        assert greedy(client) == reference_greedy(tiny_state_dict(41), root / "ref-41", PROMPTS, 8)
    finally:
        sender.kill()
