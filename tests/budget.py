"""The suite's time budget (``make test`` in 20 minutes on a 2-core machine), printed at the end of every
run: seconds per module (setup, call and teardown of its tests, reruns included), the engine starts each module
waited for, and a warning naming the slowest modules when the run passes the budget.

A warning, not a failure: the same run takes twice as long on a machine others share, and a red suite for that
would say nothing about the code. ``TITO_TEST_BUDGET_S`` sets the budget (default: 18 minutes, CI's 20 less the
install from nothing; lint runs beside the suite).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest

from tests.helpers import ServerProcess

BUDGET_S = float(os.environ.get("TITO_TEST_BUDGET_S", str(18 * 60)))
SLOWEST = 5

_t0 = [time.monotonic()]
_module_s: defaultdict[str, float] = defaultdict(float)
_tests: defaultdict[str, set[str]] = defaultdict(set)


def pytest_sessionstart(session: pytest.Session) -> None:
    _t0[0] = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::")[0]
    _module_s[module] += report.duration
    if report.when == "call":
        _tests[module].add(report.nodeid)


def _waits_by_module() -> dict[str, list[tuple[str, float]]]:
    by: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for w in ServerProcess.waits:
        by[w.module].append((w.name, w.seconds))
    return by


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _module_s:
        return
    tr = terminalreporter
    wall = time.monotonic() - _t0[0]
    waits = _waits_by_module()
    tr.section("time per module (seconds; the engine starts it waited for)")
    by_time = sorted(_module_s.items(), key=lambda kv: -kv[1])
    for module, seconds in by_time:
        mine = [(n, s) for n, s in waits.get(module, []) if s >= 0.5]
        waited = f"  waited {sum(s for _, s in mine):.0f}s: " + \
            ", ".join(f"{n} {s:.0f}s" for n, s in mine) if mine else ""
        tr.write_line(f"{seconds:8.1f}  {module} ({len(_tests[module])} tests){waited}")
    starts = ServerProcess.starts
    tr.write_line(f"{sum(_module_s.values()):8.1f}  all modules; {len(starts)} server starts "
                  f"({sum(s.seconds for s in starts):.0f}s to healthy, summed; "
                  f"{sum(w.seconds for w in ServerProcess.waits):.0f}s of it waited for by tests); "
                  f"session wall time {wall:.0f}s")
    tr.write_line("          starts: " + ", ".join(f"{s.name} {s.seconds:.0f}s" for s in starts))
    if wall > BUDGET_S:
        slow = ", ".join(f"{m} {s:.0f}s" for m, s in by_time[:SLOWEST])
        tr.write_line(f"WARNING: the suite took {wall:.0f}s, over its budget of {BUDGET_S:.0f}s "
                      f"(TITO_TEST_BUDGET_S). Slowest modules: {slow}", yellow=True, bold=True)
