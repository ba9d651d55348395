"""What both drivers share: run each client call, record its value or its error, print one JSON report.

No tito import here: the drivers run in the clients' own environments (tests/test_trainers.py)."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

REPORT: dict[str, dict[str, Any]] = {}


def step(name: str, fn: Callable[[], Any]) -> Any:
    """Run one client call: ``{"ok": true, "value": ...}`` or ``{"ok": false, "error": "Type: message"}``."""
    try:
        value = fn()
    except BaseException as e:  # noqa: BLE001 - the report says what each call did, failures included
        if isinstance(e, KeyboardInterrupt):
            raise
        REPORT[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:800],
                        "trace": traceback.format_exc()[-1500:]}
        return None
    REPORT[name] = {"ok": True, "value": value}
    return value


def barrier() -> None:
    """Between the data-plane calls and the control-plane ones: the test runs both drivers' data-plane calls side by
    side, then lets one driver at a time pause, abort and reset (a pause would freeze or abort the other's rollouts)."""
    sys.stdout.write("\nREADY\n")
    sys.stdout.flush()
    sys.stdin.readline()


def emit() -> None:
    sys.stdout.write("\nREPORT " + json.dumps(REPORT, default=repr) + "\n")
    sys.stdout.flush()
