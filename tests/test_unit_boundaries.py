"""Fast test (no engine): vLLM is imported only by the engine adapter and the modules that must run inside vLLM."""

from __future__ import annotations

import ast
import fnmatch
import re
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


# ------------------------------------------------------------------ packages: import rules, no cycles, module size

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    files = [*(ROOT / "app").rglob("*.py"), *(ROOT / "routers").rglob("*.py")]
    return {_module_name(p): p for p in sorted(files)}


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of app/ and routers/ it imports, at any level (functions and TYPE_CHECKING too: those
    are arrows of the design as much as the ones at the top). ``from pkg import name`` names the submodule when
    ``name`` is one, else the package."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in mods:
                subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
                out |= subs or {node.module}
                if len(subs) < len(node.names):
                    out.add(node.module)
        out.discard(name)
        graph[name] = out
    return graph


def _package_of(module: str) -> str:
    """``app.weights.lora`` -> ``app.weights``; ``routers.info`` -> ``routers``; ``app.main`` -> ``app.main``."""
    parts = module.split(".")
    if parts[0] == "routers":
        return "routers"
    return ".".join(parts[:2])


def package_rules() -> dict[str, set[str]]:
    """What each package may import, read from the ``Imports:`` paragraph of its ``__init__.py`` docstring (the
    one place the rule is written): every ``app.X`` / ``routers`` named there."""
    rules: dict[str, set[str]] = {}
    for init in sorted([*(ROOT / "app").glob("*/__init__.py"), ROOT / "routers" / "__init__.py"]):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        para = next((p for p in doc.split("\n\n") if p.startswith("Imports:")), None)
        assert para is not None, f"{init.relative_to(ROOT)}: the docstring has no 'Imports:' paragraph"
        rules[_module_name(init)] = {_package_of(m) for m in re.findall(r"\b(?:app\.\w+|routers)\b", para)}
    return rules


def test_every_package_keeps_its_import_rules():
    rules = package_rules()
    assert {"app.core", "app.engine", "app.weights", "app.server", "app.client", "routers"} <= rules.keys()
    broken = []
    for mod, targets in sorted(import_graph().items()):
        pkg = _package_of(mod)
        if pkg not in rules:
            continue  # app.main, app.cli, app.__main__: they put the packages together and may import any
        for t in sorted(targets):
            tpkg = _package_of(t)
            if tpkg != pkg and tpkg != "app" and tpkg not in rules[pkg]:  # "app": the root, __version__ only
                broken.append(f"{mod} imports {t} ({pkg} may import: {', '.join(sorted(rules[pkg])) or 'nothing'})")
    assert broken == [], "\n".join(broken)


def test_app_top_level_holds_only_the_entry_points():
    """New code goes into the package of its concern: at the top of app/ only what puts the packages together."""
    top = sorted(p.name for p in (ROOT / "app").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "cli.py", "main.py"], top


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return []

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return []


def test_no_import_cycle_in_app_and_routers():
    graph = import_graph()
    assert len(graph) >= 40 and graph["app.server.state"]  # the walk found the code and its imports
    cycle = find_cycle(graph)
    assert cycle == [], "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []



def test_no_module_over_500_lines():
    files = [*(ROOT / "app").rglob("*.py"), *(ROOT / "routers").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]
    files = [p for p in files if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]  # generated: scripts/gen_protos.py
    long = [f"{p.relative_to(ROOT)}: {n}" for p in sorted(files) if (n := len(p.read_text().splitlines())) > 500]
    assert long == [], "modules over 500 lines:\n" + "\n".join(long)
