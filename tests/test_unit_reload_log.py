"""Fast tests (no engine): the workers' reload timings in an update's answer (app/weights/reload_log.py)."""

from __future__ import annotations

from app.weights.reload_log import reload_seconds
from app.weights.updates import UpdateOutcome


def test_the_slowest_worker_and_the_tied_head_are_reported():
    results = [{"reload_seconds": 0.8, "retie_seconds": 0.1}, {"reload_seconds": 0.9, "retie_seconds": 0.2}, "x"]
    assert reload_seconds(results) == 0.9
    assert reload_seconds(results, "retie_seconds") == 0.2
    assert reload_seconds([{"reload_seconds": 0.5}], "retie_seconds") is None
    body = UpdateOutcome("v", "disk", 1.0, 10, reload_seconds=0.9, retie_seconds=0.2).body()
    assert body["reload_seconds"] == 0.9 and body["retie_seconds"] == 0.2
    assert "retie_seconds" not in UpdateOutcome("v", "disk", 1.0, 10, reload_seconds=0.9).body()  # an untied model
