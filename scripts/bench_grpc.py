#!/usr/bin/env python
"""gRPC vs HTTP on the same tito: throughput and CPU per request for the same workloads, in the same run.

One tito is started with ``--grpc-port``; every workload of ``scripts/bench.py`` (same prompts, same sampling) is
driven through ``/inference/v1/generate`` (bench.py's lean HTTP load generator) and through ``VllmEngine/Generate``
(a ``grpc.aio`` client built from ``smg-grpc-proto``), alternating which transport goes first from round to round.
Each load generator is a separate process in this session, as in bench.py.

Reported per workload and transport (medians over rounds): tok/s or req/s, p50, tito's CPU per request (the server
process only, not its engine processes: what the transport and tito's request handling cost) and the load
generator's CPU per request. Numbers from a machine shared with other work only compare the two transports with
each other, and even that loosely: CPU per request moves least with contention.

    python scripts/bench_grpc.py                       # 3 rounds, all workloads
    python scripts/bench_grpc.py --quick --rounds 1    # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import bench  # noqa: E402 - scripts/bench.py: its workloads and worker mode
import loadgen  # noqa: E402 - the closed loop, the HTTP load generator, CPU accounting
from bench_report import fmt  # noqa: E402

TRANSPORTS = ("http", "grpc")


async def grpc_load(target: str, wl: loadgen.Workload) -> dict[str, Any]:
    """Closed-loop load over gRPC: one channel per client (as the HTTP generator keeps one connection per client)."""
    import grpc
    from smg_grpc_proto import vllm_engine_pb2 as pb
    from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

    requests = []
    for i in range(wl.requests):
        prompt, mt = loadgen.request_spec(wl, i)
        sp = loadgen.sampling(mt)
        requests.append(pb.GenerateRequest(
            tokenized=pb.TokenizedInput(input_ids=prompt), stream=wl.stream,
            sampling_params=pb.SamplingParams(max_tokens=sp["max_tokens"], temperature=sp["temperature"],
                                              ignore_eos=sp["ignore_eos"])))
    channels = [grpc.aio.insecure_channel(target) for _ in range(wl.clients)]
    stubs = [pb_grpc.VllmEngineStub(ch) for ch in channels]

    async def send(c: int, i: int) -> int:
        got = 0
        async for r in stubs[c].Generate(requests[i]):
            if r.HasField("chunk"):
                got += len(r.chunk.token_ids)
            elif not wl.stream:
                got += len(r.complete.output_ids)
        return got

    try:
        return await loadgen.closed_loop(wl, send)
    finally:
        for ch in channels:
            await ch.close()


def _load(transport: str, server: Any, grpc_target: str, wl: loadgen.Workload, logs: Path) -> dict[str, Any]:
    from tests.helpers import engine_env

    if transport == "http":
        cmd = bench._self_cmd("--_load", server.url, json.dumps(asdict(wl)))  # bench.py's own worker mode
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_grpc_load", grpc_target, json.dumps(asdict(wl))]
    c0 = loadgen.process_cpu_s(server.proc.pid)
    res, _ = bench._worker_json(cmd, loadgen.LOAD_TIMEOUT_S + 60, logs / "load.log", engine_env())
    return loadgen.with_cpu(res, loadgen.process_cpu_s(server.proc.pid) - c0)


def run(model: str, workloads: list[loadgen.Workload], rounds: int, logs: Path, start_timeout: float) -> list[Any]:
    from tests.helpers import ServerProcess, engine_env, free_port, tito_cmd

    port, gport = free_port(), free_port()
    cmd = tito_cmd(model, port, "--max-model-len", str(bench.MAX_MODEL_LEN), "--grpc-port", str(gport))
    server = ServerProcess(cmd, port, logs / f"tito-grpc-{port}.log", env=engine_env())
    server.start(timeout=start_timeout)
    out: list[dict[str, Any]] = []
    try:
        for t in TRANSPORTS:  # both paths warm before anything is measured
            _load(t, server, f"127.0.0.1:{gport}", bench.WARMUP, logs)
        for r in range(rounds):
            order = TRANSPORTS if r % 2 == 0 else TRANSPORTS[::-1]
            this: dict[str, Any] = {t: {} for t in TRANSPORTS}
            for wl in workloads:
                for t in order:
                    this[t][wl.name] = _load(t, server, f"127.0.0.1:{gport}", wl, logs)
                    res = this[t][wl.name]
                    print(f"round {r + 1}/{rounds} {wl.name:12s} {t:4s}: {res['tok_s']:8.0f} tok/s "
                          f"{res['req_s']:7.1f} req/s  tito {res['cpu_ms_per_req']:.2f} ms CPU/req  "
                          f"{res['errors']} error(s)", file=sys.stderr, flush=True)
            out.append(this)
    finally:
        server.stop()
    return out


def table(rounds: list[dict[str, Any]], workloads: list[loadgen.Workload]) -> tuple[str, dict[str, Any]]:
    def med(t: str, wl: str, key: str) -> float | None:
        vals = [r[t][wl][key] for r in rounds if r[t][wl].get(key) is not None]
        return statistics.median(vals) if vals else None

    rows = ["| workload | transport | tok/s | req/s | p50 ms | tito CPU ms/req | client CPU ms/req | errors |",
            "|---|---|---|---|---|---|---|---|"]
    summary: dict[str, Any] = {}
    for wl in workloads:
        for t in TRANSPORTS:
            s = {k: med(t, wl.name, k) for k in ("tok_s", "req_s", "p50_ms", "cpu_ms_per_req",
                                                  "client_cpu_ms_per_req")}
            s["errors"] = sum(r[t][wl.name]["errors"] for r in rounds)
            summary.setdefault(wl.name, {})[t] = s
            rows.append(f"| {wl.name} | {t} | {fmt(s['tok_s'])} | {fmt(s['req_s'], 1)} | "
                        f"{fmt(s['p50_ms'], 1)} | {fmt(s['cpu_ms_per_req'], 2)} | "
                        f"{fmt(s['client_cpu_ms_per_req'], 2)} | {s['errors']} |")
    return "\n".join(rows), summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Model directory (default: models/tiny-qwen3, written if missing).")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", default=",".join(bench.WORKLOADS),
                   help=f"Comma-separated subset of {','.join(bench.WORKLOADS)}.")
    p.add_argument("--quick", action="store_true", help="A few requests per workload (smoke test).")
    p.add_argument("--out", default="results")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--_grpc_load", nargs=2, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns._grpc_load:  # worker: gRPC load generator in its own process, on uvloop like bench.py's
        import uvloop

        uvloop.install()
        target, spec = ns._grpc_load
        c0 = time.process_time()
        res = asyncio.run(grpc_load(target, loadgen.Workload(**json.loads(spec))))
        res["client_cpu_ms_per_req"] = (time.process_time() - c0) * 1000.0 / max(res["ok"], 1)
        print(json.dumps(res))
        return 0
    unknown = [w for w in ns.workloads.split(",") if w and w not in bench.WORKLOADS]
    if unknown:
        p.error(f"unknown workload: {', '.join(unknown)}")
    workloads = [bench.WORKLOADS[w].scaled(ns.quick) for w in ns.workloads.split(",") if w]
    model = ns.model
    if model is None:
        from app.tiny.model import make_tiny_model

        model = str(make_tiny_model(ROOT / "models" / "tiny-qwen3"))
    out = Path(ns.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rounds = run(str(Path(model).resolve()), workloads, ns.rounds, logs, ns.start_timeout)
    text, summary = table(rounds, workloads)
    print(text)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    doc = {"meta": {"time": stamp, "model": model, "rounds": ns.rounds, "quick": ns.quick},
           "summary": summary, "rounds": rounds}
    (out / "bench-grpc.json").write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {out / 'bench-grpc.json'}")
    errors = sum(s["errors"] for row in summary.values() for s in row.values())
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
