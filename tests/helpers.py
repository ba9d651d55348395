"""Test helpers: run tito (or vLLM's own server) as a real subprocess on a free port, and talk to it."""

from __future__ import annotations

import functools
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def script_module(name: str) -> Any:
    """``scripts/<name>.py`` as a module, loaded once (scripts/ is not a package). It is registered in sys.modules
    as ``tito_script_<name>``: dataclasses resolve their module's annotations through it."""
    spec = importlib.util.spec_from_file_location(f"tito_script_{name}", ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


EAGER_ENV = "TITO_ENFORCE_EAGER"
# The environment of every process the suite starts: no package index, uv offline, no model hub (see conftest).
OFFLINE_ENV = {"UV_OFFLINE": "1", "PIP_NO_INDEX": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def engine_env(extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The environment of a server the suite or a benchmark starts: this process's, with ``extra`` over it (None
    removes a name). Eager unless said otherwise (``{EAGER_ENV: None}``: tito's default, torch.compile): a compiled
    start costs seconds more even on the tiny model, and vLLM's reference server (``vllm_cmd``) runs eager too."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault(EAGER_ENV, "1")
    env["PYTHONUNBUFFERED"] = "1"
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


@dataclass(frozen=True)
class Start:
    """One server start, for the suite's time summary (tests/budget.py): its log name and the seconds until its
    health path answered 200."""

    name: str
    seconds: float


@dataclass(frozen=True)
class Wait:
    """A test module waiting for a server to be up: the module, the server's log name, the seconds it waited (less
    than the start's when the server was started ahead, tests/conftest.py's ``SharedServers``)."""

    module: str
    name: str
    seconds: float


def current_module() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]


class ServerProcess:
    """A server subprocess in its own process group, so stopping it leaves no EngineCore orphans.

    Its own process group, but this session: a new session would be a new CFS autogroup, and the kernel would then
    split the CPU between the server's group and ours. While the engine generated, that starved the test process
    (and any client in it) for the whole generation: a ``POST /resume`` answered in 2 ms reached the client after
    10 s in half of the tries, and Prometheus samples taken "during" a load all came after it. In one session the
    kernel shares the CPU task by task."""

    starts: list[Start] = []  # every healthy start of this run, in order
    waits: list[Wait] = []  # what the tests waited for
    # Set by tests/conftest.py while a test runs: whether it is marked ``engine`` (None outside a test, e.g. scripts).
    engine_allowed: bool | None = None
    # Set in the thread that starts servers ahead of the modules using them (tests/conftest.py): those starts belong to
    # no test, whatever test runs meanwhile.
    ahead = threading.local()

    def __init__(self, cmd: Sequence[str], port: int, log_path: Path, env: dict[str, str] | None = None,
                 health_path: str = "/health") -> None:
        self.cmd = list(cmd)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.env = env or engine_env()
        self.health_path = health_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.first_answers: Any = None
        self.fresh_answers: Any = None  # what a shared server answered before any test (tests/conftest.py)
        self.grpc_port: int | None = None  # a tito server's --grpc-port, when it has one

    def start(self, timeout: float = 240.0, on_answer: Callable[[ServerProcess], Any] | None = None) -> ServerProcess:
        """Start and wait until the health path answers 200. ``on_answer`` is called once, at the port's first
        answer of any status (a tito server is then still starting); what it returns is kept in ``first_answers``."""
        ahead = getattr(ServerProcess.ahead, "active", False)
        if ServerProcess.engine_allowed is False and not ahead:
            raise RuntimeError(f"a test not marked engine (pytest.mark.engine) started a server: {self.cmd[:4]}")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        t0 = time.monotonic()
        # Started by the test itself (not through SharedServers, which counts its own waits): the test waits for all of
        # it.
        waited_here = threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=str(ROOT), process_group=0)
        deadline = time.monotonic() + timeout
        # One client for every poll: httpx.get() builds a new client, and with it an SSL context (~30 ms of CPU), per
        # call; five polls a second per starting server took a third of a core from the engine starts.
        with httpx.Client(timeout=2.0) as poll:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    r = poll.get(self.url + self.health_path)
                    if on_answer is not None:
                        self.first_answers, on_answer = on_answer(self), None
                        continue
                    if r.status_code == 200:
                        seconds = time.monotonic() - t0
                        ServerProcess.starts.append(Start(self.log_path.stem, seconds))
                        if waited_here:
                            ServerProcess.waits.append(Wait(current_module(), self.log_path.stem, seconds))
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()  # whatever is left in the group (EngineCore, workers) goes too

    def kill(self) -> int | None:
        """End the server at once: SIGKILL to its whole group (server, EngineCore, workers). For fixtures' teardown,
        where nothing checks how the server exits: a graceful stop costs ~6 s a server (vLLM's engine shutdown waits
        for its worker, then kills the EngineCore after 5 s). Tests of a clean exit use ``signal``/``stop``."""
        if self.proc is None:
            return None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        return self.proc.returncode


def tito_cmd(model: str | Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tito", "serve", "--model", str(model), "--port", str(port), "--dtype", "float32",
            *extra]


def vllm_cmd(model: str | Path, port: int, *extra: str, tokens_only: bool = True, eager: bool = True) -> list[str]:
    """vLLM's own server on ``model`` with tito's settings on CPU. ``tokens_only=False``: with the model's tokenizer
    (the text routes, /v1/responses, /v1/messages) and the token API mounted by ``--enable-scale-out``.
    ``eager=False``: vLLM's default engine mode (torch.compile), as tito's default."""
    # `python -m`, not the `vllm` console script: the vllm-cpu distribution breaks importlib.metadata's lookup.
    mode = "--tokens-only" if tokens_only else "--enable-scale-out"
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), mode,
            "--dtype", "float32", "--max-model-len", "512", *(["--enforce-eager"] if eager else []),
            "--gpu-memory-utilization", "0.3", "--port", str(port), *extra]


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """Sum the samples of ``name`` (optionally matching ``labels``) in Prometheus text."""
    total = None
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, lbl = head.partition("{")
        if metric != name:
            continue
        if labels and not all(f'{k}="{v}"' in lbl for k, v in labels.items()):
            continue
        total = (total or 0.0) + float(value)
    return total


# Tests that must act while the engine is generating. On a 2-core VM the engine's worker spins on one core and the
# EngineCore on the other, and a test process can then be descheduled for seconds, so its call sometimes lands after
# the generation it targets has ended. The assertions stay strict; such a test gets up to two more tries.
TIMING = pytest.mark.flaky(reruns=2, reruns_delay=2)


def greedy_answer(client: httpx.Client) -> dict[str, list]:
    """A fixed greedy request's tokens and sampled-token logprobs: what a weight update must reproduce exactly."""
    body = {"token_ids": [3, 1, 4, 1, 5], "sampling_params": {"max_tokens": 12, "temperature": 0, "logprobs": 2}}
    r = client.post("/inference/v1/generate", json=body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return {"tokens": ch["token_ids"], "logprobs": [e["logprob"] for e in ch["logprobs"]["content"]]}


def restore_server(url: str, drop_broadcaster: bool = False, headers: dict[str, str] | None = None) -> None:
    """Leave a shared server as the next module expects it: nothing in flight, admitting (not draining, not paused),
    the base weights it was started on (version "default", consistent) and, with ``drop_broadcaster``, no weight
    broadcast group. Every step is a no-op on a server already in that state. ``headers``: the admin key of a server
    that has one."""
    with httpx.Client(base_url=url, timeout=120.0, headers=headers) as c:
        c.post("/abort_requests", json={})
        c.delete("/drain")
        state = c.get("/server_info").json()["state"]
        if state["weights_inconsistent"] or c.get("/weight_info").json()["weight_version"] != "default":
            r = c.post("/reload_weights")  # re-reads the served model: the base weights, version "default"
            assert r.status_code == 200, r.text
        if drop_broadcaster:
            # A join nobody answers drops the current group first (tito_init_broadcaster), then times out: 504.
            r = c.post("/init_broadcaster", json={"host": "127.0.0.1", "port": free_port(), "rank_offset": 0,
                                                  "inference_world_size": 1, "timeout": 1})
            assert r.status_code == 504, r.text
            r = c.post("/update_weights", json={"weight_dir": None})
            assert r.status_code == 400 and "no broadcaster" in r.text, r.text
        r = c.post("/resume")
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60
        while c.get("/health").json()["inflight"] != 0:
            assert time.monotonic() < deadline, "requests still in flight"
            time.sleep(0.05)
        assert c.get("/is_paused").json() == {"is_paused": False}
        assert c.get("/weight_info").json() == {"weight_version": "default"}
        r = c.get("/ready")
        assert r.status_code == 200, r.text
