"""A short soak (benchmarks/soak.py): weight updates under concurrent streams, every answer audited.

4 ``pause?mode=keep`` → ``update_weights`` → ``resume`` cycles, alternating two checkpoints (each update its own
version), while 32 clients stream. Every answer must come back whole (all ``max_tokens``, finish ``length``) with
``weight_versions`` spans covering it contiguously from token 0, in update order; every update must succeed. Requests
carry no ``seed`` (see benchmarks/soak.py). Runs on the shared server and leaves it on its own weights.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from app.tiny.model import make_tiny_model
from benchmarks import soak
from tests.helpers import ServerProcess


@pytest.mark.engine
def test_short_soak_loses_nothing(tito: ServerProcess, tiny_model: Path, tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path / "ckpt-b", seed=1)
    try:
        rep = asyncio.run(soak.soak(tito.url, [str(tiny_model), str(other)], updates=4, streams=32, batch=16,
                                    max_tokens=64))
    finally:
        with httpx.Client(base_url=tito.url, timeout=300) as c:
            c.post("/resume")
            assert c.post("/reload_weights").status_code == 200  # the shared server's own weights, version default
    print(rep)
    assert rep.updates == 4 and rep.failed_updates == 0, rep.samples
    assert rep.requests >= 5 * 16 and rep.ok == rep.requests, rep.samples
    assert rep.lost == 0 and rep.short == 0 and rep.spans_bad == 0, rep.samples


def test_spans_audit_catches_bad_spans() -> None:
    order = ["default", "soak-1", "soak-2"]
    good = [{"version": "default", "start": 0, "end": 3}, {"version": "soak-2", "start": 3, "end": 5}]
    assert soak.spans_problem(good, 5, order) is None
    assert "contiguous" in soak.spans_problem([{"version": "default", "start": 1, "end": 5}], 5, order)
    assert "end at 4" in soak.spans_problem([{"version": "default", "start": 0, "end": 4}], 5, order)
    assert "unknown" in soak.spans_problem([{"version": "x", "start": 0, "end": 5}], 5, order)
    back = [{"version": "soak-2", "start": 0, "end": 2}, {"version": "soak-1", "start": 2, "end": 5}]
    assert "older" in soak.spans_problem(back, 5, order)
    assert soak.spans_problem(None, 5, order) == "no weight_versions"
