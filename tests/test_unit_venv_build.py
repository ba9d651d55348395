"""The wait for a client venv built in the background (tests/venv_build.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.venv_build import wait_for_build


def test_no_build_under_way_returns_at_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TITO_X_BUILD", raising=False)
    wait_for_build("TITO_X_BUILD", "X", timeout=0)
    monkeypatch.setenv("TITO_X_BUILD", str(tmp_path / "absent.log"))
    wait_for_build("TITO_X_BUILD", "X", timeout=0)


@pytest.mark.parametrize(("rc", "pid", "error"), [
    ("0", None, None),
    ("1", None, "building X's venv failed"),
    (None, "999999999", "ended without a status"),  # the builder is gone and wrote no status
    (None, None, "still building after 0 s"),
])
def test_a_build_ends_well_or_fails_the_caller(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rc: str | None,
                                               pid: str | None, error: str | None) -> None:
    log = tmp_path / "x.log"
    log.write_text("the build's log\n")
    if rc is not None:
        Path(f"{log}.rc").write_text(rc)
    if pid is not None:
        Path(f"{log}.pid").write_text(pid)
    monkeypatch.setenv("TITO_X_BUILD", str(log))
    if error is None:
        wait_for_build("TITO_X_BUILD", "X", timeout=0)
        return
    with pytest.raises((RuntimeError, TimeoutError), match=error):  # no wait: each ends at its first look
        wait_for_build("TITO_X_BUILD", "X", timeout=0 if "still building" in error else 60)
