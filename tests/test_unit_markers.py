"""The ``engine`` marker is explicit (tests/conftest.py): a test using an engine fixture without it fails collection,
and a server started by a test without it fails that test, so ``make unit`` (``-m "not engine"``) never starts one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import unmarked_engine_tests
from tests.helpers import ServerProcess


@dataclass
class Item:
    nodeid: str
    fixturenames: list[str]
    marks: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.marks else None


def test_an_engine_fixture_without_the_mark_is_named() -> None:
    items = [Item("a", ["tmp_path"]), Item("b", ["client", "tito_url", "tito"]),
             Item("c", ["keyed_tito"], {"engine"}), Item("d", ["server", "tiny_model"])]
    assert unmarked_engine_tests(items) == ["b", "d"]  # type: ignore[arg-type]


def test_a_server_start_in_an_unmarked_test_fails(tmp_path: Path) -> None:
    assert ServerProcess.engine_allowed is False  # this test is not marked engine
    server = ServerProcess(["true"], 1, tmp_path / "x.log")
    with pytest.raises(RuntimeError, match="not marked engine"):
        server.start(timeout=1)
    assert server.proc is None  # nothing was started
