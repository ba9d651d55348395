"""The uv environments of verifiers' harness programs, pinned and built at set-up, never resolved at run time.

verifiers runs each rollout's harness program (for the ``null`` harness tito's runs use: ``program.py``, with its own
PEP 723 dependencies ``openai``, ``mcp``, ``httpx``, ``tenacity``, unpinned) through ``uv sync --script`` in the
env-server, at the first rollout. Left alone, uv resolves those names against the package index of that day: on a
fresh machine the versions differ from Prime-RL's venv, and on 2026-12-06 they broke every rollout (openai 3.63 with
httpx2 2.17 refuses an ``httpx.Timeout``). So set-up (``make prime-rl``) does it once, here:

1. writes the program where verifiers' subprocess runtime will (``SubprocessRuntime.scripts_dir``, named by the
   sha256 of its source, as ``Runtime.prepare_uv_script`` names it);
2. locks it to the versions of Prime-RL's venv (the pinned list it was built from): a copy of the program whose
   metadata adds those pins as uv constraints is locked, and its lock is the preference for the program's own lock
   (``<digest>.py.lock`` beside it, which ``uv sync --script`` reads), so the lock is the program's and every package
   both share has the venv's version;
3. builds the environment from that lock (``uv sync --script --frozen``).

At run time (``prime_env`` in run.py) Prime-RL's processes run with ``UV_OFFLINE=1`` and ``UV_FROZEN=1``: verifiers'
``uv sync --script`` then uses the lock as written, from the cache, and a program without a lock (another harness, a
new verifiers) fails at once ("requires a script lockfile") instead of resolving.

    python scripts/prime_run/harness_env.py prepare tests/trainer_clients/prime-rl-requirements.txt   # set-up
    python scripts/prime_run/harness_env.py check tests/trainer_clients/prime-rl-requirements.txt     # exit 1 + why

Runs with the Python of Prime-RL's venv (it imports verifiers to read the programs and the runtime's paths).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.uv_pip import pip_settings, uv_flags  # noqa: E402

# The harnesses tito's Prime-RL runs use (run.py: ``harness = { id = "null" }``): the module holding each program.
HARNESSES = {"null": "verifiers.v1.harnesses.null.harness"}


def venv_bin() -> Path:
    return Path(sys.executable).parent


def uv_env(offline: bool) -> dict[str, str]:
    """uv as the env-server runs it: the venv's uv and Python first on PATH (the base interpreter of the script's
    environment must be the same at set-up and at run time), no managed Python downloads."""
    env = {k: v for k, v in os.environ.items() if k not in ("UV_FROZEN", "UV_OFFLINE", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv_bin()}{os.pathsep}{env.get('PATH', '')}", UV_PYTHON_DOWNLOADS="never")
    if offline:
        env["UV_OFFLINE"] = "1"
    return env


def uv(*args: str, offline: bool, check: bool = True) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("uv", path=str(venv_bin())) or "uv"
    r = subprocess.run([exe, *args], env=uv_env(offline), capture_output=True, text=True, timeout=900)
    if check and r.returncode != 0:
        raise SystemExit(f"harness_env: `uv {' '.join(args)}` failed (exit {r.returncode}):\n{r.stderr.strip()}")
    return r


def pins(requirements: Path) -> dict[str, str]:
    """name -> version of every ``name==version`` line of the pinned list (names normalized as the lock has them)."""
    out = {}
    for line in requirements.read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            out[normalize(name)] = version.strip()
    return out


def normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def program(harness: str) -> tuple[str, Path]:
    """The harness program's source and the path verifiers' subprocess runtime runs it from."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    source = importlib.import_module(HARNESSES[harness]).PROGRAM_SOURCE
    digest = hashlib.sha256(source.encode()).hexdigest()
    return source, Path(SubprocessRuntime.scripts_dir) / f"{digest}.py"


def with_constraints(source: str, pinned: dict[str, str]) -> str:
    """The program with the pins as ``[tool.uv] constraint-dependencies`` in its PEP 723 block (before its closing
    ``# ///``): uv's constraints apply to a script only from its own metadata."""
    start = source.index("# /// script")
    end = source.index("# ///", start + len("# /// script"))
    block = "# [tool.uv]\n# constraint-dependencies = [\n" + "".join(
        f'#   "{n}=={v}",\n' for n, v in sorted(pinned.items())) + "# ]\n"
    return source[:end] + block + source[end:]


def locked_versions(lock: Path) -> dict[str, str]:
    data = tomllib.loads(lock.read_text())
    return {normalize(p["name"]): p["version"] for p in data.get("package", []) if "version" in p}


def problems(harness: str, pinned: dict[str, str]) -> list[str]:
    """Why the harness's environment is not ready to run offline with the venv's versions (empty when it is)."""
    _, path = program(harness)
    lock = path.with_name(path.name + ".lock")
    if not path.is_file() or not lock.is_file():
        return [f"harness {harness!r}: no pinned lock at {lock}"]
    out = [f"harness {harness!r}: {name} {got} in the lock, {pinned[name]} in Prime-RL's venv"
           for name, got in sorted(locked_versions(lock).items()) if name in pinned and pinned[name] != got]
    r = uv("sync", "--script", str(path), "--no-config", "--frozen", "--dry-run", offline=True, check=False)
    said = r.stdout + r.stderr
    if r.returncode != 0 or "Would make no changes" not in said:
        out.append(f"harness {harness!r}: its environment is not built from the lock ({said.strip()[-500:]})")
    return out


def prepare(harness: str, pinned: dict[str, str]) -> None:
    if not problems(harness, pinned):
        print(f"harness_env: {harness!r} ready (pinned lock, environment built)")
        return
    source, path = program(harness)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(source)
    tmp.replace(path)
    lock = path.with_name(path.name + ".lock")
    # The package sources pip is configured with, as set-up's other installs use them (not pip's constraints: the
    # pins are the constraints here).
    index = uv_flags({k: v for k, v in pip_settings().items() if k != "constraint"})
    with tempfile.TemporaryDirectory(prefix="harness-lock-") as d:
        constrained = Path(d) / "program.py"
        constrained.write_text(with_constraints(source, pinned))
        uv("lock", "--script", str(constrained), "--no-config", *index, offline=False)
        shutil.copyfile(Path(d) / "program.py.lock", lock)
    # The program's own lock, the constrained one as its preference: the same versions, the program's metadata.
    uv("lock", "--script", str(path), "--no-config", *index, offline=False)
    uv("sync", "--script", str(path), "--no-config", "--frozen", "-q", offline=False)
    if left := problems(harness, pinned):
        raise SystemExit("harness_env: " + "; ".join(left))
    others = sorted(set(locked_versions(lock)) - set(pinned))
    print(f"harness_env: {harness!r} locked to Prime-RL's venv at {lock}"
          + (f" (not in the venv, pinned by the lock: {', '.join(others)})" if others else ""))


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("prepare", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    pinned = pins(Path(argv[1]))
    if argv[0] == "prepare":
        for harness in HARNESSES:
            prepare(harness, pinned)
        return 0
    found = [p for h in HARNESSES for p in problems(h, pinned)]
    for p in found:
        print(f"harness_env: {p}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
