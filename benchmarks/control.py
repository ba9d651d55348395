"""Control-plane latency, tito beside vLLM's own server: p50/p99 of ``POST /pause?mode=keep`` + ``POST /resume``,
``POST /pause?mode=abort`` + ``POST /resume``, ``GET /is_paused`` and ``GET /health``, on an idle server and while
``--streams`` streamed generate requests run (closed loop), with the engine's step time under the same load beside
them: a keep pause cannot land before the step in progress ends, so one step is the floor of each engine call.

Each system is started fresh on the same model and engine settings, one at a time (they never share the CPU):
tito (``python -m tito serve``) and vLLM's ``--tokens-only`` server with ``VLLM_SERVER_DEV_MODE=1`` (its ``/pause``,
``/resume``, ``/is_paused``). The load comes from the lean load generator (benchmarks/clients.py) in its own
process (as in the serving benchmark); the probes run here, one at a time with a short gap, so each measures the
server, not a queue of probes; pause(abort), which ends every stream in flight, after the others and on its own
(``phase``). The step time is read the way a client sees it: the gaps between the tokens of one more stream (one
token per engine step), sent by this process beside the probes.

    python -m benchmarks control                       # tito and vllm, 256 streams, 30 s of probes per phase
    python -m benchmarks control --systems tito --streams 64 --seconds 10
    python -m benchmarks control --api-server-count 2  # both servers with two API processes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.clients import GEN_PATH, Workload, load_cmd
from benchmarks.report import pct
from benchmarks.servers import MAX_MODEL_LEN, ROOT, default_model, kill_group, start, vllm_serve_cmd

PROBES = ("pause_keep", "pause_abort", "is_paused", "health")
SYSTEMS = ("tito", "vllm")
STEP_PROBE_TOKENS = MAX_MODEL_LEN - 16  # the longest stream the context allows: a few hundred steps per request


def stats(xs: list[float]) -> dict[str, Any]:
    return {"n": len(xs), "p50_ms": pct(xs, 50), "p99_ms": pct(xs, 99), "max_ms": max(xs) * 1000.0 if xs else None}


async def step_times(url: str, stop: asyncio.Event, gaps: list[tuple[float, float]]) -> None:
    """Stream one long request after another until ``stop``; each gap between two token events is one engine step.
    A stream cut by a pause(abort) probe is simply sent again; the gap that spans a pause is not a step."""
    import httpx

    body = {"token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "stream": True,
            "sampling_params": {"max_tokens": STEP_PROBE_TOKENS, "temperature": 1.0, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as c:
        while not stop.is_set():
            last: float | None = None
            async with c.stream("POST", GEN_PATH, json=body) as r:
                async for line in r.aiter_lines():
                    if stop.is_set():
                        break
                    if not line.startswith("data:") or "token_ids" not in line:
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append((last, now))
                    last = now


async def probe(url: str, seconds: float, paused_gaps: list[tuple[float, float]], probes: tuple[str, ...] = PROBES,
                gap: float = 0.05) -> dict[str, Any]:
    """Call each probe in turn for ``seconds``; latency per probe in ms (p50, p99, max) and failures. The spans while
    generation was paused go to ``paused_gaps`` (the step-time stream drops gaps that overlap them)."""
    import httpx

    lat: dict[str, list[float]] = {k: [] for k in probes}
    failures: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for name in probes:
                t0 = time.perf_counter()
                if name == "health":
                    rs = [await c.get("/health")]
                elif name == "is_paused":
                    rs = [await c.get("/is_paused")]
                else:
                    rs = [await c.post("/pause", params={"mode": name.removeprefix("pause_")}),
                          await c.post("/resume")]
                    paused_gaps.append((t0, time.perf_counter()))
                dt = time.perf_counter() - t0
                bad = [r for r in rs if r.status_code != 200]
                if bad:
                    failures.append(f"{name}: HTTP {bad[0].status_code} {bad[0].text[:100]}")
                else:
                    lat[name].append(dt)
                await asyncio.sleep(gap)
    out: dict[str, Any] = {k: stats(v) for k, v in lat.items()}
    out["failures"] = failures[:5]
    out["failed"] = len(failures)
    return out


# tito's own account of where a control call's time goes (app/core/metrics.py): the loop's lag (what each hand-over
# between tasks waits) and each transition's part under the control plane's lock.
BREAKDOWN = {"loop_lag": ("tito_event_loop_lag_seconds", {}),
             "pause_keep_run": ("tito_control_seconds", {"call": "pause_keep", "part": "run"}),
             "pause_abort_run": ("tito_control_seconds", {"call": "pause_abort", "part": "run"}),
             "resume_run": ("tito_control_seconds", {"call": "resume", "part": "run"})}


async def scrape(url: str) -> dict[str, dict[float, float]]:
    """Cumulative bucket counts (le -> count, +inf included) of each BREAKDOWN histogram; empty off tito."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=30.0) as c:
        text = (await c.get("/metrics")).text
    out: dict[str, dict[float, float]] = {}
    for key, (name, labels) in BREAKDOWN.items():
        buckets: dict[float, float] = {}
        for line in text.splitlines():
            if not line.startswith(name + "_bucket{"):
                continue
            head, _, value = line.rpartition(" ")
            lbl = head[head.index("{") + 1:-1]
            if not all(f'{k}="{v}"' in lbl for k, v in labels.items()):
                continue
            le = lbl.split('le="')[1].split('"')[0]
            buckets[float(le)] = buckets.get(float(le), 0.0) + float(value)
        out[key] = buckets
    return out


def breakdown(before: dict[str, dict[float, float]], after: dict[str, dict[float, float]]) -> dict[str, Any]:
    """Per histogram, over the phase: samples, and the bucket bound under which 50% and 99% of them fell (ms)."""
    out: dict[str, Any] = {}
    for key, cum in after.items():
        diff = sorted((le, n - before.get(key, {}).get(le, 0.0)) for le, n in cum.items())
        total = diff[-1][1] if diff else 0.0

        def bound(q: float, diff: list[tuple[float, float]] = diff, total: float = total) -> float | None:
            return next((le * 1000.0 for le, n in diff if n >= q * total), None) if total else None

        out[key] = {"n": total, "p50_le_ms": bound(0.5), "p99_le_ms": bound(0.99)}
    return out


async def phase(url: str, seconds: float) -> dict[str, Any]:
    """The probes and, beside them, the step-time stream (steps that span a pause left out); then pause(abort) on
    its own for a third of the time: it ends every stream in flight and the load sends them all again at once, so
    it would land its aftermath on the probes after it (and on the step time) in the real cycle of an RL step."""
    before = await scrape(url)
    stop = asyncio.Event()
    stamped: list[tuple[float, float]] = []
    paused: list[tuple[float, float]] = []
    steps = asyncio.ensure_future(step_times(url, stop, stamped))
    try:
        out = await probe(url, seconds, paused, tuple(p for p in PROBES if p != "pause_abort"))
    finally:
        stop.set()
        try:
            await asyncio.wait_for(steps, 30.0)
        except (TimeoutError, Exception):  # noqa: BLE001 - the step stream is a side measurement
            steps.cancel()
    steps_s = [b - a for a, b in stamped if not any(a < pe and ps < b for ps, pe in paused)]
    out["step"] = stats(steps_s)
    aborts = await probe(url, seconds / 3, [], ("pause_abort",))
    out["pause_abort"] = aborts["pause_abort"]
    out["failures"] += aborts["failures"]
    out["failed"] += aborts["failed"]
    out["breakdown"] = breakdown(before, await scrape(url))
    return out


async def inflight(url: str) -> int:
    """Requests in flight: tito's /health says; vLLM's server counts them (running and waiting) in its metrics."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=30.0) as c:
        body = (await c.get("/health")).text
        try:
            return int(json.loads(body)["inflight"])
        except (ValueError, KeyError, TypeError):
            from tests.helpers import metric_value

            text = (await c.get("/metrics")).text
            return int(sum(metric_value(text, m) or 0 for m in ("vllm:num_requests_running",
                                                                "vllm:num_requests_waiting")))


def run_system(system: str, model: str, ns: argparse.Namespace, out: Path) -> dict[str, Any]:
    from tests.helpers import engine_env, free_port, tito_cmd, vllm_cmd

    port = free_port()
    env = engine_env()
    n = ["--api-server-count", str(ns.api_server_count)]
    if system == "tito":
        cmd = tito_cmd(model, port, "--max-model-len", str(MAX_MODEL_LEN), *n)
    else:
        cmd = vllm_cmd(model, port)
        if ns.api_server_count > 1:  # vLLM's serve command, not the module: only it runs several API processes
            cmd = vllm_serve_cmd(cmd[3:], *n)
        env = {**env, "VLLM_SERVER_DEV_MODE": "1"}  # vLLM serves /pause, /resume, /is_paused only in dev mode
    server = start(cmd, port, out / f"bench-control-{system}.log", env)
    load = None
    try:
        url = server.url
        idle = asyncio.run(phase(url, ns.seconds))
        # Enough requests to outlast the probes (the load generator builds every body up front).
        wl = Workload("control", ns.streams, ns.max_tokens, True, ns.streams * 200, "p99")
        load = subprocess.Popen(load_cmd(url, wl), stdout=subprocess.DEVNULL,
                                stderr=open(out / "bench-control-load.log", "ab"),  # noqa: SIM115
                                env=engine_env(), cwd=str(ROOT), process_group=0)
        deadline = time.monotonic() + 300
        while asyncio.run(inflight(url)) < ns.streams * 0.9:
            if time.monotonic() > deadline or load.poll() is not None:
                raise RuntimeError(f"{system}: the load never reached its streams")
            time.sleep(0.5)
        loaded = asyncio.run(phase(url, ns.seconds))
        return {"idle": idle, "loaded": loaded, "inflight_at_end": asyncio.run(inflight(url))}
    finally:
        if load is not None:
            kill_group(load)
        server.stop()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks control", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="Comma-separated, of: tito, vllm (default both).")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=30.0, help="Probe time, idle and loaded each (default 30).")
    p.add_argument("--model", default=None)
    p.add_argument("--api-server-count", type=int, default=1,
                   help="API processes of both servers (tito's control plane then runs in its control process).")
    p.add_argument("--out", default="results")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    ns = p.parse_args(argv)
    systems = [s for s in ns.systems.split(",") if s]
    if not systems or any(s not in SYSTEMS for s in systems):
        p.error(f"--systems: a comma-separated list of {', '.join(SYSTEMS)}")

    out = Path(ns.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = default_model(ns.model)
    results = {s: run_system(s, model, ns, out) for s in systems}
    doc = {"date": time.strftime("%Y-%m-%d"), "streams": ns.streams, "max_tokens": ns.max_tokens,
           "seconds": ns.seconds, "cpus": os.cpu_count(), "api_server_count": ns.api_server_count,
           "systems": results}
    (out / "bench-control.json").write_text(json.dumps(doc, indent=2))
    print_table(doc)
    failed = sum(r[ph]["failed"] for r in results.values() for ph in ("idle", "loaded"))
    return 1 if failed else 0


def print_table(doc: dict[str, Any]) -> None:
    results = doc["systems"]
    print(f"ms; loaded = {doc['streams']} closed-loop streams of {doc['max_tokens']} tokens; pause_* = pause + resume")
    print(f"{'probe':<13}{'system':<7}{'idle p50':>9}{'idle p99':>9}{'load p50':>9}{'load p99':>9}{'load max':>9}"
          f"{'p99/step p99':>14}{'p99/vllm':>10}")
    for k in (*PROBES, "step"):
        for s, r in results.items():
            i, ld = r["idle"][k], r["loaded"][k]
            step = r["loaded"]["step"]["p99_ms"]
            ref = results.get("vllm", {}).get("loaded", {}).get(k, {}).get("p99_ms")
            vs_step = "" if k == "step" or not step or ld["p99_ms"] is None else f"{ld['p99_ms'] / step:.2f}"
            vs_vllm = "" if s == "vllm" or not ref or ld["p99_ms"] is None else f"{ld['p99_ms'] / ref:.2f}"
            print(f"{k:<13}{s:<7}{_f(i['p50_ms']):>9}{_f(i['p99_ms']):>9}{_f(ld['p50_ms']):>9}{_f(ld['p99_ms']):>9}"
                  f"{_f(ld['max_ms']):>9}{vs_step:>14}{vs_vllm:>10}")
    for s, r in results.items():
        for ph in ("idle", "loaded"):
            parts = [f"{k} p50<={_f(v['p50_le_ms'])} p99<={_f(v['p99_le_ms'])}"
                     for k, v in r[ph]["breakdown"].items() if v["n"]]
            if parts:
                print(f"{s} {ph}, its own metrics (ms, bucket bounds): " + "; ".join(parts))
            if r[ph]["failed"]:
                print(f"{s} {ph}: {r[ph]['failed']} failed, e.g. {r[ph]['failures'][:2]}")


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
