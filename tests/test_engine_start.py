"""How the engine's processes start on CPU (app/engine/process_start.py): forked from the server process, which
re-executed itself once with the libraries vLLM preloads into its own processes, and with none of the server's inet
sockets left open in them.

The engine test reads the session's shared default server (it has a gRPC port too, so two listening sockets).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from app.core.settings import Settings
from app.engine import process_start
from app.engine.process_start import openmp_cpus, vllm_preload
from tests.helpers import ServerProcess

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.engine  # the tiny model; no engine starts
def test_preload_is_the_one_vllms_cpu_platform_sets(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tito finds, without importing PyTorch or vLLM, the same libraries vLLM's CPU platform puts in LD_PRELOAD
    for its processes (so a vLLM that changes them fails here)."""
    from app.engine.engine_setup import engine_args, on_cpu

    if not on_cpu():
        pytest.skip("vLLM sets no preload off the CPU platform")
    # vLLM edits os.environ while it builds the config; monkeypatch puts every variable back afterwards (set first so
    # that one absent before is recorded too, and removed again).
    for name in ("LD_PRELOAD", "VLLM_WORKER_MULTIPROC_METHOD", "NUMEXPR_MAX_THREADS", "TORCHINDUCTOR_COMPILE_THREADS",
                 "VLLM_DISABLE_SHARED_EXPERTS_STREAM", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS", "LOCAL_WORLD_SIZE",
                 "VLLM_SSM_CONV_STATE_LAYOUT", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    engine_args(Settings(model=str(tiny_model), dtype="float32")).create_engine_config()
    vllms = [lib for lib in os.environ.get("LD_PRELOAD", "").split(":") if lib]
    assert vllms, "vLLM's CPU platform preloads PyTorch's libgomp on Linux"
    assert vllm_preload("") == vllms
    assert vllm_preload(":".join(vllms)) == []


def _run(code: str, env_extra: dict[str, str]) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TITO_PRELOAD_REEXEC")} | env_extra
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


REEXEC = ("import os, sys; from app.engine.process_start import reexec_with_preload; "
          "print(os.getpid(), os.environ.get('LD_PRELOAD', ''), flush=True); reexec_with_preload(sys.argv[-1] "
          "if len(sys.argv) > 1 else os.environ['MODE'])")


def test_serve_restarts_itself_once_with_the_preload_when_the_engine_forks() -> None:
    if not process_start.vllm_cpu_build() or not vllm_preload(""):
        pytest.skip("not vLLM's CPU build on Linux: nothing to preload")
    first, second = _run(REEXEC, {"MODE": "fork"})
    pid1, _, before = first.partition(" ")
    pid2, _, after = second.partition(" ")
    assert pid1 == pid2  # exec: the same process, so a supervisor's pid stays right
    assert before == ""
    assert after.split(":") == vllm_preload("")
    # Already preloaded (the user's LD_PRELOAD, or the second run above): no restart, the preload kept as given.
    preset = ":".join(vllm_preload(""))
    assert _run(REEXEC, {"MODE": "fork", "LD_PRELOAD": preset})[0].split(" ", 1)[1] == preset
    assert len(_run(REEXEC, {"MODE": "fork", "LD_PRELOAD": preset})) == 1
    assert len(_run(REEXEC, {"MODE": "spawn"})) == 1  # spawned children get vLLM's preload from vLLM


def test_a_forked_child_closes_the_inherited_inet_sockets_and_keeps_the_rest() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    local_a, local_b = socket.socketpair()  # AF_UNIX: the child's own plumbing (multiprocessing's pipes, ZMQ ipc)
    read_end, write_end = os.pipe()
    inet = [listener.fileno(), client.fileno(), accepted.fileno()]
    pid = os.fork()
    if pid == 0:  # the child: what vLLM's fork would run first
        try:
            process_start._close_inherited_inet_sockets()
            closed = [fd for fd in inet if not _open(fd)]
            kept = _open(local_a.fileno()) and _open(write_end)
            os.write(write_end, f"{','.join(map(str, closed))};{kept}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        os.waitpid(pid, 0)
        closed, kept = os.read(read_end, 200).decode().split(";")
        assert sorted(int(fd) for fd in closed.split(",") if fd) == sorted(inet)
        assert kept == "True"
        # The parent's sockets are untouched: the connection still carries bytes both ways.
        client.sendall(b"ping")
        assert accepted.recv(4) == b"ping"
    finally:
        os.close(read_end)
        for s in (listener, client, accepted, local_a, local_b):
            s.close()


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


@pytest.mark.engine
def test_the_engine_processes_are_forked_preloaded_and_hold_no_server_socket(tito: ServerProcess) -> None:
    from app.engine.adapter import on_cpu

    if not on_cpu():
        pytest.skip("vLLM forks its processes itself off the CPU platform")
    assert tito.proc is not None and tito.grpc_port is not None
    server = psutil.Process(tito.proc.pid)
    assert "engine processes forked from this one" in tito.log_text()
    # The process the test started is the server: it re-executed itself in place, with vLLM's preload.
    assert server.environ().get("LD_PRELOAD", "").split(":")[:len(vllm_preload(""))] == vllm_preload("")
    listening = {c.laddr.port for c in server.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    assert {tito.port, tito.grpc_port} <= listening
    engine = [p for p in server.children(recursive=True) if p.name().startswith("VLLM::")]
    assert {p.name().split("::")[1][:6] for p in engine} >= {"Engine", "Worker"}, engine
    # vLLM's thread binding, which it gives a worker through the environment its OpenMP runtime reads at start,
    # holds in the forked worker too: bound to the cores vLLM chose (logged), the reserved one left to the others.
    chosen = re.search(r"local_rank=0, core ids=\[([\d, ]*)\]", tito.log_text())
    assert chosen, "vLLM logs the cores it binds the worker to"
    cores = [int(c) for c in chosen.group(1).split(",")]
    worker = next(p for p in engine if "Worker" in p.name())
    assert worker.cpu_affinity() == cores
    for p in engine:
        # Forked: the engine processes map the libraries the server loaded, uvicorn's event loop among them,
        # which a spawned engine process never imports.
        assert any("uvloop" in m.path for m in p.memory_maps()), p
        held = [c for c in p.net_connections("inet") if c.laddr.port in (tito.port, tito.grpc_port)
                or (c.raddr and c.raddr.port in (tito.port, tito.grpc_port))]
        assert held == [], (p, held)


def test_openmp_cpus_reads_the_variables_vllm_sets() -> None:
    assert openmp_cpus({"GOMP_CPU_AFFINITY": "0 1 2"}) == [0, 1, 2]  # vLLM's form with libgomp
    assert openmp_cpus({"GOMP_CPU_AFFINITY": "4-6,8 10-14:2"}) == [4, 5, 6, 8, 10, 12, 14]
    assert openmp_cpus({"OMP_PLACES": "{3,5}"}) == [3, 5]  # its form with another OpenMP
    assert openmp_cpus({"OMP_PLACES": "cores"}) is None
    assert openmp_cpus({}) is None
