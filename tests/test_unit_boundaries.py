"""Fast test (no engine): vLLM is imported only by the engine adapter and the modules that must run inside vLLM."""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import ROOT

# The engine package: the adapter, the sampling-params builder, code that runs in vLLM's workers.
ALLOWED = ("app/engine/*.py",)
# The product's top-level packages: the layers (app/), the HTTP transport (routers/), the composition root (tito/).
PACKAGES = ("app", "routers", "tito")


@dataclass(frozen=True)
class Import:
    """One import statement (or a string import) of a module: ``kind`` is ``import`` (``import m``), ``from``
    (``from m import names``) or ``dynamic`` (``importlib.import_module("m")`` / ``__import__("m")`` with a literal
    string, which a plain walk of the import statements would miss)."""

    line: int
    kind: str
    module: str
    names: tuple[str, ...] = ()


@functools.cache  # the tree is read by several tests, and again with one line changed
def imports_in(source: str, package: str = "", filename: str = "<source>") -> tuple[Import, ...]:
    """Every import in ``source`` at any level (functions, TYPE_CHECKING), in line order; relative imports are
    resolved against ``package`` (the importing module's package; without one they never name a package)."""
    found: list[Import] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, "import", a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level and package:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{target}".strip(".")
            elif node.level:
                target = "." * node.level + target  # no package to resolve against: never a package name
            found.append(Import(node.lineno, "from", target, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in \
                ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str):
            found.append(Import(node.lineno, "dynamic", node.args[0].value))
    return tuple(sorted(found, key=lambda i: i.line))


def _is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def vllm_imports(path: Path) -> list[str]:
    """Every ``import vllm...`` / ``from vllm... import`` / string import of vLLM in the file, at any level."""
    words = {"import": "import", "from": "from", "dynamic": "dynamic import of"}
    return [f"{path.name}:{i.line} {words[i.kind]} {i.module}" for i in imports_in(path.read_text(), "", str(path))
            if _is_under(i.module, "vllm")]


def test_only_the_adapter_imports_vllm():
    offenders = []
    checked = 0
    for path in sorted(p for top in PACKAGES for p in (ROOT / top).rglob("*.py")):
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
    return {_module_name(p): p for p in sorted(p for top in PACKAGES for p in (ROOT / top).rglob("*.py"))}


def tree_sources() -> dict[str, tuple[str, str]]:
    """module -> (its package, its source) for every module of app/, routers/ and tito/."""
    return {name: (".".join(path.relative_to(ROOT).parent.parts), path.read_text())
            for name, path in _modules().items()}


def tree_imports(sources: dict[str, tuple[str, str]]) -> dict[str, tuple[Import, ...]]:
    return {name: imports_in(src, package, name) for name, (package, src) in sources.items()}


def import_graph(sources: dict[str, tuple[str, str]] | None = None) -> dict[str, set[str]]:
    """module -> the modules of app/, routers/ and tito/ it imports, at any level (functions, TYPE_CHECKING: those
    are arrows of the design as much as the ones at the top), string imports included. ``from pkg import name``
    names the submodule when ``name`` is one, else the package; a string import names its longest known prefix."""
    sources = tree_sources() if sources is None else sources
    mods = sources.keys()
    graph: dict[str, set[str]] = {}
    for name, imports in tree_imports(sources).items():
        out: set[str] = set()
        for imp in imports:
            if imp.kind == "from":
                if imp.module not in mods:
                    continue
                subs = {f"{imp.module}.{n}" for n in imp.names} & mods
                out |= subs or {imp.module}
                if len(subs) < len(imp.names):
                    out.add(imp.module)
            else:
                parts = imp.module.split(".")
                known = [".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in mods]
                out |= set(known[:1]) if imp.kind == "dynamic" else ({imp.module} & mods)
        out.discard(name)
        graph[name] = out
    return graph


def _package_of(module: str) -> str:
    """``app.weights.lora`` -> ``app.weights``; ``routers.info`` -> ``routers``; ``tito.main`` -> ``tito``."""
    parts = module.split(".")
    if parts[0] in ("routers", "tito"):
        return parts[0]
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


def package_violations(graph: dict[str, set[str]], rules: dict[str, set[str]]) -> list[str]:
    broken = []
    for mod, targets in sorted(graph.items()):
        pkg = _package_of(mod)
        if pkg not in rules:
            continue  # tito (the composition root) puts the packages together and may import any
        for t in sorted(targets):
            tpkg = _package_of(t)
            if tpkg != pkg and tpkg != "app" and tpkg not in rules[pkg]:  # "app": the root, __version__ only
                broken.append(f"{mod} imports {t} ({pkg} may import: {', '.join(sorted(rules[pkg])) or 'nothing'})")
    return broken


def test_every_package_keeps_its_import_rules():
    rules = package_rules()
    assert {"app.core", "app.engine", "app.weights", "app.server", "app.client", "routers"} <= rules.keys()
    assert package_violations(import_graph(), rules) == []


# What each top-level package must never import: app/ neither the HTTP transport nor the composition root (``tito``,
# which mounts the routers), routers/ not the root. No module is exempt.
ABOVE = {"app": ("routers", "tito"), "routers": ("tito",)}


def upward_imports(imports: dict[str, tuple[Import, ...]]) -> list[str]:
    """Imports that reach up: a module under app/ importing ``routers`` (a transport, gRPC, or a layer below reaching
    into HTTP: the service layer in app/server is where both transports meet) or ``tito``; a router importing
    ``tito``."""
    return [f"{mod}:{i.line} {i.kind} {i.module}" for mod, imps in sorted(imports.items())
            for i in imps for top in ABOVE.get(mod.split(".")[0], ()) if _is_under(i.module, top)]


# Private imports the sampling validator's rewrite removes (it owns those two modules); each entry must still exist.
def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(imports: dict[str, tuple[Import, ...]]) -> set[tuple[str, str, int]]:
    """(module, what it imports, line) for every private name (``_x``, not ``__x__``) a module of tito imports from
    another one: ``from m import _x``, or a private module in a dotted path (``import m._x``, string imports too)."""
    found = set()
    for mod, imps in imports.items():
        for i in imps:
            if not any(_is_under(i.module, top) for top in PACKAGES):
                continue
            if any(_private(part) for part in i.module.split(".")):
                found.add((mod, i.module, i.line))
            found |= {(mod, f"{i.module}.{n}", i.line) for n in i.names if _private(n)}
    return found


def test_no_module_under_app_imports_the_http_routers_or_the_root():
    imports = tree_imports(tree_sources())
    assert {"app.grpc.vllm_control", "routers.info", "tito.main"} <= imports.keys()  # the walk found all three
    assert upward_imports(imports) == []


def test_no_private_name_is_imported_across_modules():
    found = private_imports(tree_imports(tree_sources()))
    assert sorted(f"{m}:{line} imports {n}" for m, n, line in found) == []


def test_a_line_that_breaks_a_rule_fails_the_checks():
    """The checks run on the real tree with one line added, and each names the line: gRPC reaching into an HTTP
    router's private helper (the imports this layout removed), and the string import by which the staging uploads
    reached back into the staging module (a cycle, and an edge no import statement shows)."""
    sources = tree_sources()
    assert upward_imports(tree_imports(sources)) == [] and package_violations(import_graph(sources), package_rules()) \
        == [] and find_cycle(import_graph(sources)) == []

    grpc_pkg, grpc_src = sources["app.grpc.vllm_control"]
    broken = {**sources, "app.grpc.vllm_control": (grpc_pkg, grpc_src + "from routers.weights import _engine_call\n")}
    line = len(grpc_src.splitlines()) + 1
    imports = tree_imports(broken)
    assert upward_imports(imports) == [f"app.grpc.vllm_control:{line} from routers.weights"]
    assert ("app.grpc.vllm_control", "routers.weights._engine_call", line) in private_imports(imports)
    assert package_violations(import_graph(broken), package_rules()) == [
        "app.grpc.vllm_control imports routers.weights (app.grpc may import: app.core, app.engine, app.server)"]

    pkg, src = sources["app.weights.stage_uploads"]
    for added in ('import importlib\nimportlib.import_module("app.weights.staging")\n',
                  '__import__("app.weights.staging")\n'):
        graph = import_graph({**sources, "app.weights.stage_uploads": (pkg, src + added)})
        assert "app.weights.staging" in graph["app.weights.stage_uploads"]
        cycle = find_cycle(graph)
        assert cycle[0] == cycle[-1] and {"app.weights.staging", "app.weights.stage_uploads"} <= set(cycle), cycle
    graph = import_graph({**sources, "app.weights.stage_uploads": (pkg, src + 'import importlib\n'
                                                                   'importlib.import_module("routers.staging")\n')})
    assert package_violations(graph, package_rules()) == [
        "app.weights.stage_uploads imports routers.staging (app.weights may import: app.core, app.engine)"]


def test_the_composition_root_has_no_place_under_app():
    """The line that once made app/main.py the one exempt module (mounting the HTTP routers), back in a module of that
    name under app/, fails the check; so does a layer or a router importing the composition root."""
    sources = tree_sources()
    added = "from tito.main import create_app\n"
    broken = dict(sources)
    broken["app.main"] = ("app", "from routers import ALL\n")
    lines = {}
    for mod in ("app.server.startup", "routers.info"):
        pkg, src = sources[mod]
        broken[mod] = (pkg, src + added)
        lines[mod] = len(src.splitlines()) + 1
    assert upward_imports(tree_imports(broken)) == [
        "app.main:1 from routers", f"app.server.startup:{lines['app.server.startup']} from tito.main",
        f"routers.info:{lines['routers.info']} from tito.main"]
    assert package_violations(import_graph(broken), package_rules()) == [
        "app.server.startup imports tito.main (app.server may import: app.core, app.engine, app.weights)",
        "routers.info imports tito.main (routers may import: app.core, app.engine, app.server, app.weights, routers)"]


def test_the_import_reader_sees_every_form():
    src = ("import app.core.x\nfrom app.engine import y as z, _w\nif T:\n    from . import sib\n"
           "def f():\n    importlib.import_module('app.server.s')\n    __import__('routers')\n"
           "    import_module(name)\n")
    assert imports_in(src, "app.weights") == (
        Import(1, "import", "app.core.x"), Import(2, "from", "app.engine", ("y", "_w")),
        Import(4, "from", "app.weights", ("sib",)), Import(6, "dynamic", "app.server.s"),
        Import(7, "dynamic", "routers"))
    assert private_imports({"m": imports_in(src, "app.weights")}) == {("m", "app.engine._w", 2)}


def test_app_top_level_holds_no_module():
    """New code goes into the package of its concern; what puts the packages together is the ``tito`` package."""
    assert sorted(p.name for p in (ROOT / "app").glob("*.py")) == ["__init__.py"]
    assert sorted(p.name for p in (ROOT / "tito").glob("*.py")) == ["__init__.py", "__main__.py", "cli.py", "main.py"]


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


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) >= 40 and graph["app.server.state"]  # the walk found the code and its imports
    cycle = find_cycle(graph)
    assert cycle == [], "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []



def test_no_module_over_500_lines():
    files = [p for top in (*PACKAGES, "scripts", "benchmarks") for p in (ROOT / top).rglob("*.py")]
    files = [p for p in files if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]  # generated: scripts/gen_protos.py
    long = [f"{p.relative_to(ROOT)}: {n}" for p in sorted(files) if (n := len(p.read_text().splitlines())) > 500]
    assert long == [], "modules over 500 lines:\n" + "\n".join(long)
