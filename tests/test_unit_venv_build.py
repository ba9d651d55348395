"""The wait for a client venv built in the background (tests/venv_build.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.venv_build import venv_python, wait_for_build


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


def test_a_machine_without_a_prerequisite_skips_saying_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The Makefile's ``-bg`` target writes ``skip: <what is missing>`` instead of building (no Python 3.12, say): the
    caller gets that reason to skip with, not a failure; a finished build without the venv names the make target."""
    log = tmp_path / "venv-x.build.log"
    log.write_text("SkyRL's client needs Python 3.12 (python3.12 not found)\n")
    Path(f"{log}.rc").write_text("skip: SkyRL's client needs Python 3.12 (python3.12 not found)\n")
    monkeypatch.setenv("TITO_X_BUILD", str(log))
    monkeypatch.setenv("TITO_X_VENV", str(tmp_path / "venv-x"))
    why = "SkyRL's client needs Python 3.12 (python3.12 not found)"
    assert wait_for_build("TITO_X_BUILD", "X", timeout=0) == why
    assert venv_python("X", "TITO_X_BUILD", "TITO_X_VENV", "x") == why
    Path(f"{log}.rc").write_text("0\n")
    assert venv_python("X", "TITO_X_BUILD", "TITO_X_VENV", "x") == "X's venv is missing: make x (TITO_X_VENV)"
    (tmp_path / "venv-x" / "bin").mkdir(parents=True)
    (tmp_path / "venv-x" / "bin" / "python").write_text("")
    (tmp_path / "venv-x" / ".installed").write_text("")
    assert venv_python("X", "TITO_X_BUILD", "TITO_X_VENV", "x") == tmp_path / "venv-x" / "bin" / "python"
