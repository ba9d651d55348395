"""Fast test (no engine): vLLM is imported only by the engine adapter and the modules that must run inside vLLM."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

from tests.helpers import ROOT

# The engine package: the adapter, the sampling-params builder, code that runs in vLLM's workers.
ALLOWED = ("app/engine/*.py",)


def vllm_imports(path: Path) -> list[str]:
    """Every ``import vllm...`` / ``from vllm... import`` in the file, at any level (functions, TYPE_CHECKING)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"{path.name}:{node.lineno} import {a.name}") for a in node.names
                      if a.name == "vllm" or a.name.startswith("vllm.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == "vllm" or node.module.startswith("vllm.")):
            found.append((node.lineno, f"{path.name}:{node.lineno} from {node.module}"))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in \
                ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) and \
                str(node.args[0].value).split(".")[0] == "vllm":
            found.append((node.lineno, f"{path.name}:{node.lineno} dynamic import of {node.args[0].value}"))
    return [text for _, text in sorted(found)]


def test_only_the_adapter_imports_vllm():
    offenders = []
    checked = 0
    for path in sorted([*(ROOT / "app").rglob("*.py"), *(ROOT / "routers").glob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if any(fnmatch.fnmatch(rel, pat) for pat in ALLOWED):
            continue
        checked += 1
        offenders += vllm_imports(path)
    assert checked >= 20  # the globs found the code
    assert offenders == [], "vLLM imported outside the engine adapter:\n" + "\n".join(offenders)


def test_the_checker_sees_every_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vllm.outputs import X\n"
                   "def f():\n    import vllm.envs\n    import importlib\n    importlib.import_module('vllm.x')\n"
                   "import vllmish\nfrom .vllm import y\n")
    assert [f.split(" ", 1)[1] for f in vllm_imports(src)] == [
        "from vllm.outputs", "import vllm.envs", "dynamic import of vllm.x"]
