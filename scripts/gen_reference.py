"""Write the generated parts of docs/reference/ from the code (``--check``: exit 1 if any is stale).

- ``flags.md``: the ``tito serve`` flags, from the Settings fields (app/core/settings.py);
- ``routes.md``: the HTTP routes, from the app's own OpenAPI schema (``create_app`` on the fake engine, so no vLLM
  engine starts; the auth plane of each path from app/server/security.py);
- ``metrics.md``: tito's own Prometheus families, from the registry once every module that declares one is imported.

Each page is hand-written around a block between ``<!-- gen:NAME:start -->`` and ``<!-- gen:NAME:end -->``; only the
block is rewritten. A test (tests/test_docs.py) runs ``--check``.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REFERENCE = ROOT / "docs" / "reference"


def flags_block() -> str:
    from app.core.settings import FLAGS, flags_markdown
    from app.engine.vllm_args import vllm_defaults

    theirs = vllm_defaults()
    return flags_markdown({f.name: theirs[f.name] for f in FLAGS if f.name in theirs})


def vllm_args_block() -> str:
    """vLLM's own `vllm serve` arguments, group by group, and where tito sends each."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    from app.core.settings import FLAGS
    from app.engine.vllm_args import HANDLER_OPTIONS, REFUSED, SERVER_OPTIONS, serve_parser

    engine = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    tito = {f.name for f in FLAGS}
    rows = ["| group | arguments | in tito |", "|---|---|---|"]
    for group in serve_parser()._action_groups:
        if group.title == "tito":
            continue
        by_use: dict[str, list[str]] = {}
        for a in group._group_actions:
            if not a.option_strings or a.dest == "help":
                continue
            name = f"`{a.option_strings[0]}`"
            if a.dest in REFUSED:
                use = f"refused at start: {REFUSED[a.dest]}"
            elif a.dest in tito:
                use = "tito's flag of the same name (above)"
            elif a.dest in HANDLER_OPTIONS:
                use = "vLLM's OpenAI handlers"
            elif a.dest in SERVER_OPTIONS:
                use = "tito's HTTP server, as vLLM's applies it"
            elif a.dest in engine:
                use = "the engine"
            else:
                use = "not used by tito"
            by_use.setdefault(use, []).append(name)
        for use, names in by_use.items():
            rows.append(f"| {group.title} | {', '.join(names)} | {_cell(use)} |")
    return "\n".join(rows)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def routes_block() -> str:
    from app.core.settings import Settings
    from app.server.security import classify
    from tests.fake_engine import FakeEngine
    from tito.main import create_app

    app = create_app(Settings.build(env={}, model="/models/fake"), engine=FakeEngine())  # type: ignore[arg-type]
    schema = app.openapi()
    rows = ["| method | path | plane | what it does | body | query |", "|---|---|---|---|---|---|"]
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            body = ""
            content = op.get("requestBody", {}).get("content", {})
            for media, spec in content.items():
                ref = spec.get("schema", {}).get("$ref", "")
                body = f"`{ref.rsplit('/', 1)[-1]}` ({media})" if ref else f"({media})"
                break
            query = ", ".join(f"`{p['name']}`" for p in op.get("parameters", []) if p.get("in") == "query")
            summary = _cell(op.get("summary") or "")
            plane = classify(path).value
            rows.append(f"| {method.upper()} | `{path}` | {plane} | {summary} | {body} | {query} |")
    return "\n".join(rows)


# Modules that declare Prometheus families outside app/core/metrics.py; optional ones may lack their extra.
METRIC_MODULES = ("app.core.metrics", "tito.main", "app.weights.staging")
OPTIONAL_METRIC_MODULES = ("app.grpc.status",)


def metrics_block() -> str:
    from prometheus_client import REGISTRY

    for name in METRIC_MODULES:
        importlib.import_module(name)
    for name in OPTIONAL_METRIC_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    seen: dict[str, tuple[str, str, str]] = {}
    # The registry maps every exposed name to its collector; a collector's describe() gives its family.
    for collector in set(REGISTRY._names_to_collectors.values()):  # noqa: SLF001 (no public listing of collectors)
        describe = getattr(collector, "describe", None)
        if describe is None:  # the process and platform collectors: not tito's
            continue
        labels = tuple(getattr(collector, "_labelnames", ()))
        for family in describe():
            if not family.name.startswith("tito_"):
                continue
            exposed = family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")
            seen[exposed] = (family.type, ", ".join(f"`{x}`" for x in labels), _cell(family.documentation))
    rows = ["| family | type | labels | help |", "|---|---|---|---|"]
    for name in sorted(seen):
        kind, labels, doc = seen[name]
        rows.append(f"| `{name}` | {kind} | {labels} | {doc} |")
    return "\n".join(rows)


PAGES: dict[str, tuple[str, Callable[[], str]]] = {
    "flags": ("flags.md", flags_block),
    "vllm-args": ("flags.md", vllm_args_block),
    "routes": ("routes.md", routes_block),
    "metrics": ("metrics.md", metrics_block),
}


def render(text: str, name: str, block: str) -> str:
    pattern = re.compile(rf"(<!-- gen:{name}:start -->\n).*?(<!-- gen:{name}:end -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"no <!-- gen:{name}:start/end --> block in docs/reference/{PAGES[name][0]}")
    return pattern.sub(lambda m: m.group(1) + block + "\n" + m.group(2), text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    check = "--check" in argv
    stale: list[str] = []
    for name, (filename, make) in PAGES.items():
        path = REFERENCE / filename
        text = path.read_text()
        new = render(text, name, make())
        if new == text:
            continue
        if check:
            stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(new)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"stale: {', '.join(stale)}; run python scripts/gen_reference.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

