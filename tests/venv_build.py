"""The wait for a client venv that ``make test`` builds in the background (``trainers-bg``, ``areal-bg``,
``prime-rl-bg`` in the Makefile): each build writes its log at the path in an environment variable, its exit status
to ``<log>.rc`` and its pid to ``<log>.pid``. Standard library only: ``scripts/prime_run`` waits with it outside the
suite too."""

from __future__ import annotations

import os
import time
from pathlib import Path

BUILD_TIMEOUT = 1800.0  # s: a fresh machine downloads the whole venv (3 to 19 minutes measured for SkyRL's)


def wait_for_build(env_var: str, what: str, timeout: float = BUILD_TIMEOUT) -> str | None:
    """Return once the build named by ``env_var`` has ended well (at once when no build is under way), or why it was
    not built: the machine lacks a prerequisite (a status ``skip: <what is missing>``, e.g. no Python 3.12), which
    the caller skips with. A build that failed, died without a status or outlasts ``timeout`` raises, so a test fails
    instead of skipping its client."""
    build = os.environ.get(env_var)
    if not build or not Path(build).is_file():
        return None
    log, rc, pid = Path(build), Path(build + ".rc"), Path(build + ".pid")
    deadline = time.monotonic() + timeout
    while not rc.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}'s venv still building after {timeout:.0f} s: {log}")
        if pid.is_file() and not Path(f"/proc/{pid.read_text().strip()}").exists() and not rc.is_file():
            raise RuntimeError(f"{what}'s venv build ended without a status:\n{log.read_text()[-3000:]}")
        time.sleep(2.0)
    status = rc.read_text().strip()
    if status.startswith("skip:"):
        return status.removeprefix("skip:").strip()
    if status != "0":
        raise RuntimeError(f"building {what}'s venv failed:\n{log.read_text()[-3000:]}")
    return None


def venv_python(what: str, build_var: str, venv_var: str, target: str, timeout: float = BUILD_TIMEOUT) -> Path | str:
    """The Python of the client venv named by ``venv_var`` (default ``~/.cache/tito/venv-<target>``) once its build
    (``build_var``) has ended, or why it cannot be had here (a string to skip with)."""
    if (why := wait_for_build(build_var, what, timeout)) is not None:
        return why
    venv = Path(os.environ.get(venv_var) or Path.home() / ".cache" / "tito" / f"venv-{target}")
    py = venv / "bin" / "python"
    if (venv / ".installed").is_file() and py.is_file():
        return py
    return f"{what}'s venv is missing: make {target} ({venv_var})"
