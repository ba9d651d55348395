"""scripts/bench.py runs end to end on a tiny workload (a smoke test: it checks the harness, not the numbers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, engine_env


@pytest.mark.engine
def test_bench_quick_run_writes_table_json_and_chart(tiny_model: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "scripts/bench.py", "--quick", "--rounds", "1", "--systems", "inprocess,tito",
         "--workloads", "64x64,stream64x64,1x1,mixed", "--model", str(tiny_model), "--out", str(out_dir)],
        capture_output=True, text=True, cwd=ROOT, env=engine_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for wl in ("64x64", "stream64x64", "1x1", "mixed"):
        assert any(line.startswith(f"{wl} ") and " tito " in f" {line} " for line in proc.stdout.splitlines()), wl
    assert "tito/inprocess" in proc.stdout

    doc = json.loads((out_dir / "bench.json").read_text())
    summary = doc["summary"]
    for wl in ("64x64", "stream64x64", "1x1", "mixed"):
        for system in ("inprocess", "tito"):
            m = summary["workloads"][wl][system]
            assert m["errors"] == 0 and m["req_s"] > 0 and m["p50_ms"] > 0, (wl, system, m)
            # Read from clock ticks (10 ms): a quick workload may take less than one, so only >= 0 is certain.
            assert m["cpu_ms_per_req"] is not None and m["cpu_ms_per_req"] >= 0, (wl, system, m)
        assert summary["workloads"][wl]["tito/inprocess"] is not None or wl == "1x1"
    # Every request of the quick 64x64 workload (4 clients x 2 requests x 8 tokens) was counted.
    assert doc["rounds"][0]["tito"]["64x64"]["tokens"] == 4 * 2 * 8
    assert doc["rounds"][0]["tito"]["stream64x64"]["tokens"] == 4 * 2 * 8
    assert summary["cold_errors"] == {"inprocess": 0, "tito": 0}
    mem = summary["memory"]["tito"]
    assert mem["server_rss_mb"] > 50 and mem["engine_rss_mb"] > 50 and 0 < mem["server_uss_mb"] < mem["server_rss_mb"]
    png = out_dir / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
