"""The docs say what the code does: fast tests (no engine), and two on the shared default server.

- every ``tito`` command in a shell block of README or docs/ parses with tito's own argument parser, every
  ``make`` target exists, every ``python scripts/...`` names a script that exists, every ``python -m benchmarks NAME
  ...`` names a benchmark and parses with its flags;
- every ``TITO_*`` variable they name exists (a flag's, or one the code reads);
- every route in the HTTP API table is served, every /server_info key is on its page, every ``tito`` subcommand is
  in the client guide;
- README stays a front page (≤ 250 lines, its links resolve), and no page carries internal issue numbers or commit
  hashes;
- on a real engine: README's and the first guides' curl bodies answer, and README's Python snippet and ``tito``
  commands run as written (a page that goes stale fails here).

The generated reference pages (flags, routes, metrics) are checked by ``make lint`` (``scripts/gen_reference.py
--check``), which ``make test`` runs before pytest: not twice.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from app.core.settings import FLAGS
from app.engine.vllm_args import serve_parser
from tests.helpers import ROOT
from tito.cli import build_parser

README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.S | re.M)


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _shell_commands(markdown: str) -> list[list[str]]:
    """Each simple command of the markdown's shell blocks as argv: continuations joined, split at ``&&``, ``||``,
    ``;``, ``|`` and ``&``, comments and leading ``VAR=value`` assignments dropped."""
    out: list[list[str]] = []
    for block in SHELL_BLOCK.findall(markdown):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending += line
            lexer = shlex.shlex(pending, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            try:
                tokens = list(lexer)
            except ValueError:  # a quoted string that goes on to the next line
                pending += "\n"
                continue
            pending = ""
            argv: list[str] = []
            for token in [*tokens, ";"]:
                if token and set(token) <= set(";&|"):
                    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
                        argv.pop(0)
                    if argv:
                        out.append(argv)
                    argv = []
                else:
                    argv.append(token)
    return out


def test_the_command_splitter():
    """The splitter the checks below rely on: continuations, chains, background jobs, env prefixes, comments."""
    text = ("```bash\nA=1 B='x y' tito serve \\\n  --port 1 & # comment\ncurl -s x | jq . && make unit\n"
            "curl -d '{\n  \"a\": 1}' u\n```\n")
    assert _shell_commands(text) == [["tito", "serve", "--port", "1"], ["curl", "-s", "x"], ["jq", "."],
                                     ["make", "unit"], ["curl", "-d", '{\n  "a": 1}', "u"]]


def _make_targets() -> set[str]:
    """The targets make itself knows (its database, without running a rule): rules written by ``$(eval ...)``, as the
    trainer venvs' are, do not appear in the Makefile's text."""
    out = subprocess.run(["make", "-pRrq", "-C", str(ROOT), ":"], capture_output=True, text=True, timeout=60).stdout
    return set(re.findall(r"^([a-z][\w-]*):", out, re.M))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_tito_commands_parse(page: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    make_targets = _make_targets()
    for argv in _shell_commands(page.read_text()):
        prog = Path(argv[0]).name
        if prog == "tito":
            try:
                if argv[1:2] == ["serve"]:  # vLLM's serve parser with tito's flags (app/engine/vllm_args.py)
                    serve_parser().parse_args(argv[2:])
                else:
                    parser.parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{_name(page)}: {shlex.join(argv)!r} does not parse: {capsys.readouterr().err}")
        elif prog == "make":
            targets = [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
            assert set(targets) <= make_targets, f"{_name(page)}: {shlex.join(argv)!r}: no such make target"
        elif py := next((i for i, a in enumerate(argv) if Path(a).name.startswith("python")), None):
            # after a wrapper too (flock LOCK python ..., timeout N python ...)
            args = argv[py + 1:]
            if args[:1] and args[0].startswith("scripts/"):
                assert (ROOT / args[0]).is_file(), f"{_name(page)}: {args[0]} does not exist"
            elif args[:2] == ["-m", "benchmarks"]:
                _check_benchmark(page, args[2:], capsys)


def _check_benchmark(page: Path, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.__main__ import COMMANDS, parser

    assert args and args[0] in COMMANDS, f"{_name(page)}: python -m benchmarks {shlex.join(args)}: no such benchmark"
    # Placeholders a page writes for the reader to fill in parse as any value would.
    try:
        parser(args[0]).parse_args([a for a in args[1:] if a != "..."])
    except SystemExit:
        pytest.fail(f"{_name(page)}: python -m benchmarks {shlex.join(args)!r} does not parse: "
                    f"{capsys.readouterr().err}")


def test_every_tito_command_is_documented():
    commands = re.search(r"\{([\w,-]+)\}", build_parser().format_usage())
    assert commands is not None
    page = (DOCS / "guides" / "client.md").read_text()
    missing = [c for c in commands.group(1).split(",") if f"`tito {c}" not in page]
    assert len(commands.group(1).split(",")) > 5 and not missing, f"docs/guides/client.md lacks {missing}"


def test_tito_variables_exist():
    known = {f.env for f in FLAGS}
    for where in ("app", "routers", "tito", "tests", "scripts"):
        for source in (ROOT / where).rglob("*.py"):
            known |= set(re.findall(r"TITO_[A-Z0-9_]+", source.read_text()))
    for name in ("Makefile", "Dockerfile"):
        known |= set(re.findall(r"TITO_[A-Z0-9_]+", (ROOT / name).read_text()))
    for page in PAGES:
        unknown = set(re.findall(r"TITO_[A-Z0-9_]+", page.read_text())) - known
        assert not unknown, f"{_name(page)} names variables nothing reads: {sorted(unknown)}"


def test_api_table_routes_are_served():
    from app.core.settings import Settings
    from tests.fake_engine import FakeEngine
    from tito.main import create_app

    app = create_app(Settings.build(env={}, model="/models/fake"), engine=FakeEngine())  # type: ignore[arg-type]
    served = {getattr(r, "path", None) for r in app.routes}
    rows = re.findall(r"^\| (?:GET|POST|DELETE|PUT)[^|]* \| (.*?) \| ", (DOCS / "reference" / "api.md").read_text(),
                      re.M)
    assert len(rows) > 30
    for cell in rows:
        for path in re.findall(r"`(/[^`?]*)", cell):
            assert path in served, f"docs/reference/api.md lists {path}, which the app does not serve"


# The pages whose curl examples against localhost:8000 a newcomer pastes first; the engine test below sends them.
CURL_PAGES = [README, DOCS / "getting-started.md", DOCS / "guides" / "generation.md"]
CURL_PATHS = ("/inference/v1/generate", "/v1/completions", "/v1/chat/completions")


def _curl_examples() -> list[tuple[str, str, dict]]:
    """(page, path, JSON body) of every ``curl localhost:8000<path> ... -d '<json>'`` on CURL_PAGES."""
    import json

    out = []
    for page in CURL_PAGES:
        for argv in _shell_commands(page.read_text()):
            if Path(argv[0]).name != "curl" or "-d" not in argv:
                continue
            url = next(a for a in argv if a.startswith("localhost:8000"))
            path = url.removeprefix("localhost:8000")
            if path in CURL_PATHS:
                out.append((_name(page), path, json.loads(argv[argv.index("-d") + 1])))
    return out


def test_curl_examples_are_found():
    """The engine test below has something to send: every page on CURL_PAGES shows a generate call."""
    examples = _curl_examples()
    assert {page for page, _, _ in examples} == {_name(p) for p in CURL_PAGES}
    assert {path for _, path, _ in examples} == set(CURL_PATHS)


@pytest.mark.engine
def test_curl_examples_answer_on_a_real_server(tito_url: str) -> None:
    """README's and the first guides' curl bodies, sent to the shared default server: 200 and the tokens asked for
    (the example's model name is replaced by the server's own)."""
    import httpx

    with httpx.Client(base_url=tito_url, timeout=120.0) as c:
        served = c.get("/v1/models").json()["data"][0]["id"]
        for page, path, body in _curl_examples():
            if "model" in body:
                body["model"] = served
            r = c.post(path, json=body)
            assert r.status_code == 200, f"{page}: {path} {body}: {r.status_code} {r.text}"
            if body.get("stream"):
                assert r.text.rstrip().endswith("data: [DONE]"), f"{page}: {path}: {r.text[-200:]}"
                continue
            answer = r.json()
            if path == "/inference/v1/generate":
                tokens = answer["choices"][0]["token_ids"]
            else:
                tokens = answer["usage"]["completion_tokens"] * [0]
            assert 0 < len(tokens) <= body.get("sampling_params", body).get("max_tokens", 10**6), (page, answer)


PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


# The `tito` client commands a page shows that run as written against the default server (no file of the reader's,
# no other model): README's and operations' (the others name a checkpoint, an adapter or an image).
RUNNABLE = frozenset({"generate", "status", "drain", "undrain", "pause", "resume"})


def _readme_snippets() -> tuple[str, list[list[str]]]:
    """README's Python snippet (the one that uses the client) and the pages' runnable ``tito`` commands."""
    [snippet] = [b for b in PYTHON_BLOCK.findall(README.read_text()) if "TitoClient(" in b]
    commands = [argv for page in PAGES for argv in _shell_commands(page.read_text())
                if argv[0] == ".venv/bin/tito" and argv[1] in RUNNABLE and "--image" not in argv]
    return snippet, commands


def test_readme_snippets_are_found():
    snippet, commands = _readme_snippets()
    assert "http://127.0.0.1:8000" in snippet and "update_weights(" in snippet
    assert [argv[1] for argv in commands] == ["generate", "status", "drain", "undrain"]


@pytest.mark.engine
def test_readme_snippets_run_as_written_on_a_real_server(tito_url: str, tiny_model: Path) -> None:
    """README's Python snippet and the pages' runnable ``tito`` commands, run as written (only the URL is the
    shared server's) from the checkout's root, as a newcomer runs them after ``make serve``: they exit 0, the
    snippet's weight update lands (version step_7) and leaves the server resumed, the drain is undone. The server is
    put back (base weights) afterwards."""
    import httpx

    from tests.helpers import restore_server

    snippet, commands = _readme_snippets()
    # `make serve` allows paths under its working directory, where README's `models/tiny-qwen3` is; the suite's
    # server allows only the test tree, where the same weights (the tiny model, same seed) stand in for them.
    snippet = snippet.replace('"models/tiny-qwen3"', repr(str(tiny_model)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TITO_")} | {"TITO_URL": tito_url}
    try:
        out = subprocess.run([sys.executable, "-c", snippet.replace("http://127.0.0.1:8000", tito_url)], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr
        assert out.stdout.rstrip().endswith("length"), out.stdout  # print(out.token_ids, ..., out.finish_reason)
        with httpx.Client(base_url=tito_url, timeout=30) as c:
            assert c.get("/weight_info").json() == {"weight_version": "step_7"}
            assert c.get("/is_paused").json() == {"is_paused": False}
        for argv in commands:
            out = subprocess.run([sys.executable, "-m", "tito", *argv[1:]], cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=120)
            assert out.returncode == 0, (argv, out.stderr)
            assert out.stdout.strip(), argv
        assert httpx.get(tito_url + "/ready", timeout=30).status_code == 200  # drained, then undrained
    finally:
        restore_server(tito_url)


async def test_server_info_keys_are_documented():
    """Every section of /server_info and every key in it (but vLLM's own ``vllm_config`` / ``vllm_env``) is named on
    the server-info page: the schema only grows, and its page grows with it."""
    from tests.test_fast_http import serve

    page = (DOCS / "reference" / "server-info.md").read_text()
    documented = set(re.findall(r"`([a-z_0-9]+)`", page))
    async with serve() as (client, _):
        info = (await client.get("/server_info")).json()
    missing = [section for section in info if section not in documented]
    for section, value in info.items():
        if isinstance(value, dict) and section not in ("vllm_config", "vllm_env"):
            missing += [f"{section}.{key}" for key in value if key not in documented]
    assert len(info) >= 8 and not missing, f"docs/reference/server-info.md does not name {missing}"


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


# "issue 31", "issues 25–31" (an internal tracker's numbers), a commit hash (7 to 40 hex digits, a letter among them).
INTERNAL = re.compile(r"\bissues? #?\d+|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", re.I)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_internal_issue_numbers_or_commit_hashes(page: Path) -> None:
    lines = [f"{i}: {line}" for i, line in enumerate(page.read_text().splitlines(), 1) if INTERNAL.search(line)]
    assert not lines, f"{_name(page)}:\n" + "\n".join(lines)
