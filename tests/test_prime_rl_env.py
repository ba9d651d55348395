"""Prime-RL's processes resolve and install nothing at run time (scripts/prime_run/run.py's ``prime_env``).

verifiers prepares every harness program with a shell line that first fetches the newest uv (``_ENSURE_UV``: ``pip
install -U --user uv``, else astral.sh's installer through curl or wget) and then runs ``uv sync --script``. Under
``prime_env`` that fetch must install nothing and the program must run on the uv pinned in Prime-RL's venv, on any
machine, with or without internet.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from scripts.prime_run.run import PRIME_RL_VENV, REQUIREMENTS, prime_env, prime_rl_missing


def test_verifiers_uv_fetch_installs_nothing_and_the_pinned_uv_runs(tmp_path: Path) -> None:
    if (why := prime_rl_missing()) is not None:
        pytest.skip(why)
    env = {**prime_env(), "HOME": str(tmp_path)}
    python = str(PRIME_RL_VENV / "bin" / "python")
    # verifiers' own line, from the installed package (not a copy of it).
    ensure = subprocess.run([python, "-c", "from verifiers.v1.runtimes.base import _ENSURE_UV; print(_ENSURE_UV)"],
                            env=env, capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert "pip install" in ensure and "astral.sh" in ensure
    out = subprocess.run(["sh", "-c", f"{{ {ensure}; }} && command -v uv && uv --version"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # The installer's download went to the route to nowhere (prime_env's proxy), not off the machine: refused there
    # on every machine, whatever its internet (pip's attempt fails first: no index, and no --user install in a venv).
    assert re.search(r"curl: \(7\) Failed to connect to 127\.0\.0\.1 port 9\b", out.stderr), out.stderr
    where, version = out.stdout.strip().splitlines()[-2:]
    assert Path(where) == PRIME_RL_VENV / "bin" / "uv", out.stdout
    pinned = re.search(r"^uv==(\S+)$", REQUIREMENTS.read_text(), re.M)
    assert pinned is not None and version.split()[1] == pinned.group(1)
    # Nothing was installed: no uv under the (empty) HOME that the fetch installs into.
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith("uv")], sorted(map(str, tmp_path.rglob("*")))
