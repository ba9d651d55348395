"""Prime-RL's own processes against tito: its ``rl`` launcher writes the configs, its ``env-server`` and
``orchestrator`` run unchanged from the source snapshot, tito's stand-in trainer (``trainer.py`` beside this file)
takes the trainer's place. Used by ``scripts/seed_run.py`` (``make seed-run``) and tests/test_sidecar_fleet.py (its
Prime-RL run).

    run = PrimeRun(out, model_dir="models/qwen3-0.6b", served_name="Qwen3-0.6B", base_url="http://127.0.0.1:8000/v1",
                   admin_urls=["http://127.0.0.1:8100"], steps=3)
    result = run.run(on_version=lambda k: ...)   # called once every admin URL serves step k's weights

Everything runs in the caller's session (new process groups, never new sessions: CFS autogrouping would split two
cores between sessions), and every wait has a timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.venv_build import wait_for_build

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PRIME_RL_SRC = Path(os.environ.get("TITO_PRIME_RL_SRC", ROOT.parent / "shared" / "thirdparty" / "prime-rl"))
PRIME_RL_VENV = Path(os.environ.get("TITO_PRIME_RL_VENV", Path.home() / ".cache" / "tito" / "venv-prime-rl"))
REQUIREMENTS = ROOT / "tests" / "trainer_clients" / "prime-rl-requirements.txt"
TASKSET = "tito-even"
# A proxy nothing listens on: Prime-RL's processes reach the run's own hosts (NO_PROXY) and nothing else.
NO_ROUTE = "http://127.0.0.1:9"




def prime_rl_missing() -> str | None:
    """Why Prime-RL's processes cannot run here (None when they can): a prerequisite this machine lacks (its source
    snapshot, a venv that was not built). ``make test`` builds Prime-RL's venv in the background (``prime-rl-bg``):
    this waits for that build to end first, and its failure is an error, not a reason; so is a venv whose harness
    environment is not prepared (set-up's job: ``make prime-rl``), since the run would otherwise resolve it."""
    if (why := wait_for_build("TITO_PRIME_RL_BUILD", "Prime-RL")) is not None:
        return why
    if not (PRIME_RL_SRC / "src" / "prime_rl").is_dir():
        return f"Prime-RL's source snapshot is not at {PRIME_RL_SRC} (set TITO_PRIME_RL_SRC)"
    if not (PRIME_RL_VENV / ".installed").is_file():
        return f"Prime-RL's venv is not built at {PRIME_RL_VENV} (make prime-rl)"
    check = subprocess.run([str(PRIME_RL_VENV / "bin" / "python"), str(HERE / "harness_env.py"), "check",
                            str(REQUIREMENTS)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    if check.returncode != 0:
        raise RuntimeError(f"Prime-RL's harness environment is not prepared (make prime-rl):\n{check.stderr.strip()}")
    return None


def stop_in_order(p: subprocess.Popen[bytes], timeout: float = 60) -> int | None:
    """Stop a server as a supervisor does: SIGTERM to its own process only, so it ends its children in its order (tito
    drains, leaves Dynamo's discovery, stops its sidecar and then its engine, which must not be signalled first: an
    engine core that gets the signal before tito logs itself dead); whatever of its process group is left after
    ``timeout`` (or after it exited) is SIGKILLed. Returns its exit code (None if it had to be killed)."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        code: int | None = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if code is None:
        p.wait(timeout=30)
    return code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def prime_env(hosts: Iterable[str] = ()) -> dict[str, str]:
    """The environment of Prime-RL's processes: the stand-ins first (see standins/README.md), then the taskset, then
    Prime-RL's source; its venv's bin first on PATH (the env-server's harness program runs through its ``uv``).

    Nothing is installed or resolved at run time: uv runs offline from the harness's pinned lock
    (``harness_env.py``, made at set-up; a program without one fails instead of resolving), pip has no index, and
    HTTP(S) goes through a proxy nothing listens on except to loopback and ``hosts`` (the run's servers), so
    verifiers' fetch of the newest uv before each harness program (``pip install --user uv``, then astral.sh's
    installer) falls back to the venv's pinned uv on every machine, not only on one without internet."""
    paths = [HERE / "standins", HERE / "env", PRIME_RL_SRC / "src",
             PRIME_RL_SRC / "packages" / "prime-rl-configs" / "src"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    no_proxy = ",".join(dict.fromkeys(["localhost", "127.0.0.1", "::1", *hosts]))
    env.update(PYTHONPATH=os.pathsep.join(map(str, paths)), PATH=f"{PRIME_RL_VENV / 'bin'}{os.pathsep}{env['PATH']}",
               WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
               LOGURU_COLORIZE="0", NO_COLOR="1", UV_OFFLINE="1", UV_FROZEN="1", UV_PYTHON_DOWNLOADS="never",
               PIP_NO_INDEX="1", http_proxy=NO_ROUTE, https_proxy=NO_ROUTE, HTTP_PROXY=NO_ROUTE,
               HTTPS_PROXY=NO_ROUTE, no_proxy=no_proxy, NO_PROXY=no_proxy)
    for name in ("all_proxy", "ALL_PROXY"):
        env.pop(name, None)
    return env


UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _seconds(text: str) -> float:
    """Seconds from Prime-RL's ``format_time`` ("850ms", "12.3s", "1m 33s", "2h 5m", "1d 3h")."""
    return sum(float(n) * UNIT_S[u] for n, u in re.findall(r"([\d.]+)(ms|[dhms])", text))


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


@dataclass
class PrimeRun:
    """One RL run of Prime-RL's orchestrator against tito (see the module doc). ``base_url``: the data plane (Dynamo's
    frontend, or a tito), with ``/v1``; ``admin_urls``: each tito's own HTTP origin (what Dynamo's RL discovery
    lists). The run's defaults are Prime-RL's, except what a 2-core CPU needs: a small batch and in-flight cap, short
    completions, and a learning rate that moves bf16 weights."""

    out: Path
    model_dir: Path
    served_name: str
    base_url: str
    admin_urls: list[str]
    steps: int = 3
    seq_len: int = 512
    batch_size: int = 8
    group_size: int = 4
    max_inflight: int = 8
    max_tokens: int = 32
    lr: float = 1e-3
    max_off_policy_steps: int | None = None
    train_layers: int = 0  # the stand-in trainer's --train-layers (0: the whole model)
    trainer_threads: int = 0  # its --threads (0: torch's default, one per core)
    timeout: float = 1800.0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    run_dir: Path | None = None

    def hosts(self) -> list[str]:
        """The hosts of the run's servers (the data plane and every admin URL)."""
        return [h for u in (self.base_url, *self.admin_urls) if (h := urlsplit(u).hostname)]

    # ------------------------------------------------------------------------------------------------ configs
    def rl_toml(self) -> str:
        """Prime-RL's ``rl`` config for this run (what a user writes; its launcher derives the rest)."""
        zmq = free_port()
        while not _bindable(zmq + 1):  # the transport binds port and port + 1
            zmq = free_port()
        orch: dict[str, Any] = {"batch_size": self.batch_size, "group_size": self.group_size,
                                "env_server_base_port": free_port()}
        if self.max_off_policy_steps is not None:
            orch["max_off_policy_steps"] = self.max_off_policy_steps
        lines = [f"output_dir = {_toml(str(self.out / 'prime-rl'))}", f"max_steps = {self.steps}",
                 f"seq_len = {self.seq_len}", "", f"[model]\nname = {_toml(self.served_name)}", "",
                 f"[rollout_transport]\ntype = \"zmq\"\nport = {zmq}", "",
                 "[orchestrator]", *(f"{k} = {_toml(v)}" for k, v in orch.items()), "",
                 f"[orchestrator.concurrency]\nmax_inflight = {self.max_inflight}", "",
                 "[orchestrator.model.client]", f"base_url = {_toml(self.base_url)}",
                 f"admin_base_url = {_toml(self.admin_urls)}", "",
                 f"[orchestrator.tokenizer]\nname = {_toml(str(self.model_dir))}", "",
                 "[orchestrator.renderer]\nname = \"default\"", "",
                 f"[orchestrator.train.sampling]\nmax_completion_tokens = {self.max_tokens}", "",
                 "[[orchestrator.train.source]]",
                 "env = " + _toml({"taskset": {"id": TASKSET},
                                   "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}), "",
                 f"[trainer.tokenizer]\nname = {_toml(str(self.model_dir))}", "",
                 f"[trainer.optim]\nlr = {self.lr}", ""]
        return "\n".join(lines)

    def configure(self) -> Path:
        """Write rl.toml and run Prime-RL's launcher on it (``rl @ rl.toml --dry-run``): it writes the orchestrator's,
        the env-server's and the trainer's configs, as it does before it starts them."""
        self.out.mkdir(parents=True, exist_ok=True)
        # Prime-RL names the model once for the trainer, the orchestrator and the renderer (its launcher requires
        # the same name), and loads the tokenizer by that name: the served name, which resolves to the model's files
        # as a directory in the processes' working directory (no model hub here).
        link = self.out / self.served_name
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(self.model_dir.resolve(), target_is_directory=True)
        (self.out / "rl.toml").write_text(self.rl_toml())
        log = self.out / "rl-launcher.log"
        with log.open("wb") as f:
            rc = subprocess.run([str(PRIME_RL_VENV / "bin" / "python"), "-m", "prime_rl.entrypoints.rl", "@",
                                 str(self.out / "rl.toml"), "--dry-run"], env=prime_env(self.hosts()), stdout=f,
                                stderr=subprocess.STDOUT, timeout=300, cwd=self.out).returncode
        runs = sorted((self.out / "prime-rl").glob("*/configs/orchestrator.json"))
        if rc != 0 or not runs:
            raise RuntimeError(f"Prime-RL's launcher failed (exit {rc}): {log.read_text()[-3000:]}")
        self.run_dir = runs[-1].parent.parent
        return self.run_dir

    # ------------------------------------------------------------------------------------------------ processes
    def _start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self.out / f"{name}.log").open("wb")
        p = subprocess.Popen(argv, env=prime_env(self.hosts()), stdout=log, stderr=subprocess.STDOUT, cwd=self.out,
                             process_group=0)
        self.procs[name] = p
        return p

    def start(self) -> None:
        assert self.run_dir is not None
        py = str(PRIME_RL_VENV / "bin" / "python")
        cfg = self.run_dir / "configs"
        envs = sorted((cfg / "envs" / "train").glob("*.json"))
        self._start("env-server", [py, "-m", "prime_rl.entrypoints.env_server", "@", str(envs[0])])
        self._start("trainer", [py, str(HERE / "trainer.py"), "@", str(cfg / "trainer.json"),
                                "--model-dir", str(self.model_dir), "--train-layers", str(self.train_layers),
                                "--threads", str(self.trainer_threads)])
        self._start("orchestrator", [py, "-m", "prime_rl.entrypoints.orchestrator", "@",
                                     str(cfg / "orchestrator.json")])

    def stop(self) -> None:
        """End every process of the run (their process groups: the env-server's workers and chat programs too)."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)  # what is left of the group (workers that ignore SIGTERM)
            except ProcessLookupError:
                pass

    # ------------------------------------------------------------------------------------------------ the run
    def run(self, on_version: Callable[[int], None] | None = None,
            sample: Callable[[], None] | None = None) -> dict[str, Any]:
        """Configure, start, and wait for the orchestrator to exit (``timeout``). ``on_version(k)``: called once all
        admin URLs serve step ``k``'s weights (``weight_version`` ``step_k``); ``sample()``: every half second.
        Returns what the run's files and logs say (see ``results``)."""
        self.configure()
        t0 = time.monotonic()
        self.start()
        seen = -1
        try:
            orch = self.procs["orchestrator"]
            while orch.poll() is None:
                if time.monotonic() - t0 > self.timeout:
                    raise TimeoutError(f"the orchestrator did not finish within {self.timeout:.0f}s")
                for name in ("env-server", "trainer"):
                    rc = self.procs[name].poll()
                    if rc not in (None, 0):
                        raise RuntimeError(f"{name} exited with {rc}: {self.tail(name)}")
                if sample is not None:
                    sample()
                version = self.served_step()
                while on_version is not None and version is not None and seen < version:
                    seen += 1
                    on_version(seen)
                time.sleep(0.5)
            trainer = self.procs["trainer"]
            try:
                trainer.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
        finally:
            wall = time.monotonic() - t0
            self.stop()
        return self.results(wall)

    def served_step(self) -> int | None:
        """The step every admin URL serves from this run's broadcasts (the least of them), by the weight record in
        its ``/server_info`` (a label such as ``step_1`` alone could be another run's); None while one does not."""
        assert self.run_dir is not None
        broadcasts = (self.run_dir / "broadcasts").resolve()
        steps = []
        for url in self.admin_urls:
            try:
                state = httpx.get(url + "/server_info", timeout=10).json().get("state") or {}
            except (httpx.HTTPError, ValueError):
                return None
            weights = ((state.get("weight_record") or {}).get("record") or {}).get("weights") or {}
            where = Path(weights.get("dir") or "/")
            if where.parent != broadcasts or not re.fullmatch(r"step_\d+", where.name):
                return None
            steps.append(int(where.name.split("_")[1]))
        return min(steps) if steps else None

    def tail(self, name: str, n: int = 4000) -> str:
        return (self.out / f"{name}.log").read_text(errors="replace")[-n:]

    def trainer_record(self, step: int, timeout: float = 120) -> dict[str, Any]:
        """What the stand-in trainer wrote for ``step`` (its probe's greedy tokens, its logprob gap to tito)."""
        assert self.run_dir is not None
        path = self.run_dir / "tito-trainer" / f"step_{step}.json"
        deadline = time.monotonic() + timeout
        while not path.is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no trainer record for step {step} at {path}")
            time.sleep(0.2)
        return json.loads(path.read_text())

    def results(self, wall: float) -> dict[str, Any]:
        """The run as Prime-RL's files say it: the orchestrator's exit code and step lines, the rollouts (from its
        ``traces.jsonl``: how many, how many errored, their policy versions), the trainer's records."""
        assert self.run_dir is not None
        orch_log = self.tail("orchestrator", 10**7)
        steps = [{"step": int(m.group(1)), "reward": float(m.group(2)), "error": float(m.group(3))}
                 for m in re.finditer(r"Step (\d+) \|[^|]*\| Reward ([-\d.]+) .*?Error ([\d.]+)%", orch_log)]
        loop = re.search(r"Orchestrator step loop done in ((?:[\d.]+(?:ms|[dhms]) ?)+)", orch_log)
        rollouts = errored = 0
        versions: dict[str, dict[int, list[list[int]]]] = {"all": {}, "effective": {}}
        for subset in versions:
            for f in sorted(self.run_dir.glob(f"rollouts/step_*/train/{subset}/traces.jsonl")):
                step = int(f.parts[-4].split("_")[1])
                for line in f.read_text().splitlines():
                    ep = json.loads(line)
                    if subset == "all":
                        rollouts += 1
                        errored += (not ep.get("ok", True)) or bool(ep.get("errors"))
                    pol = ep["run"]["work"].get("policy") or {}
                    versions[subset].setdefault(step, []).append([pol.get("start", -1), pol.get("end", -1)])
        records = [json.loads(p.read_text()) for p in sorted(self.run_dir.glob("tito-trainer/step_*.json"),
                                                             key=lambda p: int(p.stem.split("_")[1]))]
        loop_s = _seconds(loop.group(1)) if loop else None
        return {"orchestrator_exit": self.procs["orchestrator"].returncode, "steps_logged": steps,
                "orchestrator_loop_s": loop_s, "wall_s": wall, "rollouts": rollouts, "failed_rollouts": errored,
                "policy_versions": versions["all"], "effective_policy_versions": versions["effective"],
                "trainer": records, "run_dir": str(self.run_dir)}

