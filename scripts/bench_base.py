"""The ``base`` system of scripts/bench.py: tito from another checkout or commit, run in the same rounds as the
working tree's (an A/B in one run)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def from_checkout(cmd: list[str], base: str) -> list[str]:
    """``tito_cmd``'s command importing tito from the checkout ``base`` instead of this one (whose command lives in
    ``tito.cli``, or ``app.cli`` in checkouts before the composition root moved out of ``app``)."""
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
    """The round's order: tito and base swap places every other round, so neither always runs first."""
    if r % 2 == 0 or not {"tito", "base"} <= set(systems):
        return systems
    swap = {"tito": "base", "base": "tito"}
    return [swap.get(x, x) for x in systems]
