"""Shared fixtures. One tito server (real vLLM engine, tiny model, fp32) is shared by the whole session."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from app.tiny_model import make_tiny_model
from tests.helpers import ServerProcess, engine_env, free_port, tito_cmd


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "engine: needs a real vLLM engine (slow start)")


# Source text that starts a real engine (tito, vLLM's server, a Dynamo or smg front end in front of them).
_STARTS_ENGINE = ("start_tito(", "ServerProcess(", "tito_cmd(", "start_grpc_pair(", "Reference(")
_ENGINE_FIXTURES = {"tito", "tito_url", "tiny_model", "vllm_server"}


@functools.cache
def _starts_engine(func: Callable[..., object]) -> bool:
    try:
        src = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    return any(s in src for s in _STARTS_ENGINE)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``engine`` every test that starts or uses a real engine: itself, or through any fixture it depends on
    (so ``make unit`` / ``-m "not engine"`` runs only the fast tests)."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = [d for ds in (info.name2fixturedefs.values() if info else ()) for d in ds]
        func = getattr(item, "function", None)
        if _ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) or \
                any(_starts_engine(d.func) for d in defs) or (func is not None and _starts_engine(func)):
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model, written fresh for the session (deterministic from its seed)."""
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3")


def start_tito(tmp_path_factory: pytest.TempPathFactory, model: Path, *extra: str,
               env: dict[str, str] | None = None, name: str = "tito") -> ServerProcess:
    """Start a tito server subprocess on a free port; the test temp tree is an allowed weight root.

    Between ``free_port()`` releasing the port and the server binding it, any outgoing connection on the machine may
    take that ephemeral port. Such a start fails with "address already in use" and is retried on another port."""
    for attempt in range(3):
        port = free_port()
        cmd = tito_cmd(model, port, "--allowed-weight-root", str(tmp_path_factory.getbasetemp()), *extra)
        log = tmp_path_factory.mktemp("logs") / f"{name}.log"
        server = ServerProcess(cmd, port, log, env=engine_env(env))
        try:
            return server.start(timeout=float(os.environ.get("TITO_TEST_START_TIMEOUT", "240")))
        except RuntimeError:
            server.stop()  # no EngineCore left behind
            if attempt == 2 or "address already in use" not in server.log_text().lower():
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def tito(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The shared default server. Tests must leave it as they found it (not paused, not draining, base weights)."""
    server = start_tito(tmp_path_factory, tiny_model)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tito_url(tito: ServerProcess) -> str:
    return tito.url


@pytest.fixture
def client(tito_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tito_url, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="session")
def reference(tiny_model: Path):  # noqa: ANN201 - returns tests.reference.Reference
    from tests.reference import Reference

    return Reference(tiny_model)
