#!/usr/bin/env python
"""Control-plane latency under load: p50/p99 of ``GET /health``, ``GET /is_paused`` and ``POST /pause?mode=keep`` +
``POST /resume``, on an idle server and while ``--streams`` streamed generate requests run (closed loop).

The load comes from scripts/bench.py's lean load generator in its own process (as in the main benchmark); the probes
run here, one at a time, with a short gap, so each probe measures the server, not a queue of probes.

    python scripts/bench_control.py                       # tiny model, 256 streams, 30 s of probes
    python scripts/bench_control.py --streams 64 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench import MAX_MODEL_LEN, _kill_group  # noqa: E402
from loadgen import Workload  # noqa: E402

PROBES = ("health", "is_paused", "pause_resume")


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] * 1000.0


async def probe(url: str, seconds: float, gap: float = 0.05) -> dict[str, Any]:
    """Call each probe in turn for ``seconds``; latency per probe in ms (p50, p99, max) and failures."""
    import httpx

    lat: dict[str, list[float]] = {k: [] for k in PROBES}
    failures: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for name in PROBES:
                t0 = time.perf_counter()
                if name == "health":
                    rs = [await c.get("/health")]
                elif name == "is_paused":
                    rs = [await c.get("/is_paused")]
                else:
                    rs = [await c.post("/pause", params={"mode": "keep"}), await c.post("/resume")]
                dt = time.perf_counter() - t0
                bad = [r for r in rs if r.status_code != 200]
                if bad:
                    failures.append(f"{name}: HTTP {bad[0].status_code} {bad[0].text[:100]}")
                else:
                    lat[name].append(dt)
                await asyncio.sleep(gap)
    out: dict[str, Any] = {k: {"n": len(v), "p50_ms": pct(v, 50), "p99_ms": pct(v, 99),
                               "max_ms": max(v) * 1000.0 if v else None} for k, v in lat.items()}
    out["failures"] = failures[:5]
    out["failed"] = len(failures)
    return out


async def busy_streams(url: str) -> int:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=30.0) as c:
        return int((await c.get("/health")).json()["inflight"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=30.0, help="Probe time, idle and loaded each (default 30).")
    p.add_argument("--model", default=None)
    p.add_argument("--url", default=None, help="A running tito (default: start one on the tiny model).")
    p.add_argument("--out", default="results")
    ns = p.parse_args(argv)

    from tests.helpers import ServerProcess, engine_env, free_port, tito_cmd

    out = Path(ns.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    server = None
    url = ns.url
    if url is None:
        model = ns.model
        if model is None:
            from app.tiny.model import make_tiny_model

            model = str(make_tiny_model(ROOT / "models" / "tiny-qwen3"))
        port = free_port()
        server = ServerProcess(tito_cmd(model, port, "--max-model-len", str(MAX_MODEL_LEN)), port,
                               out / "bench-control-server.log", env=engine_env())
        server.start(timeout=900)
        url = server.url
    load = None
    try:
        idle = asyncio.run(probe(url, ns.seconds))
        # Enough requests to outlast the probes (the load generator builds every body up front).
        wl = Workload("control", ns.streams, ns.max_tokens, True, ns.streams * 200, "p99")
        load = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench.py"), "--_load", url,
                                 json.dumps(asdict(wl))], stdout=subprocess.DEVNULL,
                                stderr=open(out / "bench-control-load.log", "ab"),  # noqa: SIM115
                                env=engine_env(), cwd=str(ROOT), process_group=0)
        deadline = time.monotonic() + 300
        while asyncio.run(busy_streams(url)) < ns.streams * 0.9:
            if time.monotonic() > deadline or load.poll() is not None:
                raise RuntimeError("the load never reached its streams")
            time.sleep(0.5)
        loaded = asyncio.run(probe(url, ns.seconds))
        inflight_after = asyncio.run(busy_streams(url))
    finally:
        if load is not None:
            _kill_group(load)
        if server is not None:
            server.stop()
    doc = {"streams": ns.streams, "max_tokens": ns.max_tokens, "seconds": ns.seconds, "idle": idle,
           "loaded": loaded, "inflight_at_end": inflight_after}
    (out / "bench-control.json").write_text(json.dumps(doc, indent=2))
    print(f"{'probe':<14}{'idle p50':>10}{'idle p99':>10}{'load p50':>10}{'load p99':>10}{'load max':>10}  (ms, "
          f"{ns.streams} streams)")
    for k in PROBES:
        i, ld = idle[k], loaded[k]
        print(f"{k:<14}{_f(i['p50_ms']):>10}{_f(i['p99_ms']):>10}{_f(ld['p50_ms']):>10}{_f(ld['p99_ms']):>10}"
              f"{_f(ld['max_ms']):>10}")
    return 1 if idle["failed"] or loaded["failed"] else 0


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
