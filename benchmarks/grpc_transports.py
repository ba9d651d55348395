"""gRPC vs HTTP on the same tito: throughput and CPU per request for the same workloads, in the same run.

One tito is started with ``--grpc-port``; every workload of the serving benchmark (same prompts, same sampling) is
driven through each transport, the order rotating from round to round:

    http              ``/inference/v1/generate`` (the lean HTTP load generator, benchmarks/clients.py)
    grpc              smg's ``VllmEngine/Generate`` (a ``grpc.aio`` client built from ``smg-grpc-proto``)
    inference         ``vllm.Inference``: ``Generate`` (unary) for a non-streamed workload, ``GenerateStream`` for a
                      streamed one
    inference-stream  ``vllm.Inference/GenerateStream`` for every workload: the only call Dynamo's sidecar makes

The ``vllm.Inference`` client asks as Dynamo's sidecar does (tito's protos, app/grpc/proto): the served model name
from ``vllm.Control/GetModelInfo``, a request id, text and token ids back, over 8 channels shared by the clients
(the sidecar's default ``--grpc-connections``). Each load generator is a separate process in this session, as in
the serving benchmark. Each round also runs ``inprocess`` (its floor: vLLM's AsyncLLM in one process, same
workloads) while tito idles, so what each transport adds above the engine client is measured as the serving
benchmark measures the HTTP route.

``--bare`` adds ``bare`` and ``bare-stream``: the same ``vllm.Inference`` calls against a ``grpc.aio`` server in a
process of its own that answers without an engine (the tokens asked for, a message each, no checks, no text): the CPU
per request of grpc.aio itself, the floor of any Python servicer that sends what the engine produced step by step.

Reported per workload and transport (medians over rounds): tok/s or req/s, p50, tito's CPU per request (the server
process only, not its engine processes: what the transport and tito's request handling cost), the load generator's
CPU per request, and for each gRPC transport (its CPU - inprocess) / (HTTP's - inprocess): the median of the
per-round ratios and their range. Throughput from a machine shared with other work means little; CPU per request
moves least with contention.

    python -m benchmarks grpc                       # 3 rounds, all workloads and transports
    python -m benchmarks grpc --workloads stream64x64,64x64,1x1 --transports http,inference,inference-stream
    python -m benchmarks grpc --quick --rounds 1    # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks import clients as loadgen
from benchmarks import serving as bench
from benchmarks.probes import process_cpu_s
from benchmarks.report import fmt
from benchmarks.servers import (
    MAX_MODEL_LEN,
    ROOT,
    default_model,
    from_checkout,
    kill_group,
    module_cmd,
    run_json,
    start,
)

TRANSPORTS = ("http", "grpc", "inference", "inference-stream")
SIDECAR_CONNECTIONS = 8  # Dynamo's sidecar: --grpc-connections, default 8


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


async def inference_load(target: str, wl: loadgen.Workload, stream: bool) -> dict[str, Any]:
    """Closed-loop load over ``vllm.Inference``, asked as Dynamo's sidecar asks: ``GenerateStream`` (or ``Generate``
    when ``stream`` is false) with the served model name, a request id, text and token ids back, over a few channels
    that every client shares. An answer without ``finish_info`` is an error, as at Dynamo's frontend."""
    import uuid

    import grpc

    from app.grpc.proto import vllm_control_pb2 as cpb
    from app.grpc.proto import vllm_control_pb2_grpc as cpb_grpc
    from app.grpc.proto import vllm_inference_pb2 as ipb
    from app.grpc.proto import vllm_inference_pb2_grpc as ipb_grpc

    channels = [grpc.aio.insecure_channel(target) for _ in range(min(wl.clients, SIDECAR_CONNECTIONS))]
    model = (await cpb_grpc.ControlStub(channels[0]).GetModelInfo(cpb.GetModelInfoRequest())).served_model_name
    requests = []
    for i in range(wl.requests):
        prompt, mt = loadgen.request_spec(wl, i)
        sp = loadgen.sampling(mt)
        requests.append(ipb.GenerateRequest(
            request_id=str(uuid.uuid4()), model=model, token_ids=ipb.TokenIds(ids=prompt),
            temperature=sp["temperature"], sampling=ipb.RandomSampling(num_sequences=1),
            stopping=ipb.StoppingCriteria(max_new_tokens=sp["max_tokens"], ignore_eos=sp["ignore_eos"]),
            response=ipb.ResponseOptions(output_text=True, output_token_ids=True)))
    stubs = [ipb_grpc.InferenceStub(ch) for ch in channels]
    messages = 0

    async def send(c: int, i: int) -> int:
        nonlocal messages
        stub = stubs[c % len(stubs)]
        if not stream:
            out = (await stub.Generate(requests[i])).outputs
            messages += 1
            if not out.HasField("finish_info"):
                raise RuntimeError("answer without finish_info")
            return len(out.token_ids)
        got, finished = 0, False
        async for r in stub.GenerateStream(requests[i]):
            messages += 1
            got += len(r.outputs.token_ids)
            finished = r.outputs.HasField("finish_info")
        if not finished:
            raise RuntimeError("stream ended without finish_info")
        return got

    try:
        res = await loadgen.closed_loop(wl, send)
        res["messages_per_req"] = messages / max(res["requests"], 1)
        return res
    finally:
        for ch in channels:
            await ch.close()


async def bare_server(port: int) -> None:
    """A ``vllm.Inference`` (and ``Control.GetModelInfo``) server with no engine behind it: each request gets its
    ``max_new_tokens`` tokens, one message a token (the last with ``finish_info``), or all in one for ``Generate``."""
    import grpc

    from app.grpc.proto import vllm_control_pb2 as cpb
    from app.grpc.proto import vllm_control_pb2_grpc as cpb_grpc
    from app.grpc.proto import vllm_inference_pb2 as ipb
    from app.grpc.proto import vllm_inference_pb2_grpc as ipb_grpc

    def message(first: bool, ids: list[int], last: bool) -> Any:
        msg = ipb.GenerateResponse()
        if first:
            msg.prompt_info.num_prompt_tokens = 16
        msg.outputs.num_tokens = len(ids)
        msg.outputs.token_ids.extend(ids)
        if last:
            msg.outputs.finish_info.num_output_tokens = len(ids)
            msg.outputs.finish_info.finish_reason = ipb.FinishInfo.FinishReason.LENGTH
        return msg

    class Inference(ipb_grpc.InferenceServicer):
        async def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802
            return message(True, list(range(request.stopping.max_new_tokens)), True)

        async def GenerateStream(self, request: Any, context: Any) -> None:  # noqa: N802
            n = request.stopping.max_new_tokens
            for i in range(n):
                await context.write(message(i == 0, [i], i == n - 1))

    class Control(cpb_grpc.ControlServicer):
        async def GetModelInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
            return cpb.ModelInfo(model_id="bare", served_model_name="bare")

    server = grpc.aio.server()
    ipb_grpc.add_InferenceServicer_to_server(Inference(), server)
    cpb_grpc.add_ControlServicer_to_server(Control(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def run_bare(workloads: list[loadgen.Workload], logs: Path) -> dict[str, Any]:
    """The ``bare`` transports: the bare server in its own process (this session), driven as tito's is."""
    from tests.helpers import engine_env, free_port

    port = free_port()
    proc = subprocess.Popen(module_cmd("benchmarks.grpc_transports", "--_bare_server", str(port)),
                            stdout=subprocess.PIPE, env=engine_env(), cwd=str(ROOT), process_group=0)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the bare gRPC server did not start")
        server = SimpleNamespace(proc=proc)
        out: dict[str, Any] = {"bare": {}, "bare-stream": {}}
        for wl in [bench.WARMUP, *workloads]:
            for t, inner in (("bare", "inference"), ("bare-stream", "inference-stream")):
                out[t][wl.name] = _load(inner, server, f"127.0.0.1:{port}", wl, logs)
        return out
    finally:
        kill_group(proc)


def _load(transport: str, server: Any, grpc_target: str, wl: loadgen.Workload, logs: Path) -> dict[str, Any]:
    from tests.helpers import engine_env

    if transport == "http":
        cmd = loadgen.load_cmd(server.url, wl)
    else:
        cmd = module_cmd("benchmarks.grpc_transports", "--_grpc_load", grpc_target, json.dumps(asdict(wl)),
                         "--transport", transport)
    c0 = process_cpu_s(server.proc.pid)
    res, _ = run_json(cmd, loadgen.LOAD_TIMEOUT_S + 60, logs / "load.log", engine_env())
    return loadgen.with_cpu(res, process_cpu_s(server.proc.pid) - c0)


def _start(model: str, logs: Path, start_timeout: float, base: str | None,
           tito_args: tuple[str, ...] = ()) -> tuple[Any, str]:
    """A tito with ``--grpc-port`` and ``tito_args`` (``base``: imported from that checkout, as bench.py's base
    system); the server and its gRPC target."""
    from tests.helpers import engine_env, free_port, tito_cmd

    port, gport = free_port(), free_port()
    cmd = tito_cmd(model, port, "--max-model-len", str(MAX_MODEL_LEN), "--grpc-port", str(gport), *tito_args)
    if base is not None:
        cmd = from_checkout(cmd, base)
    return start(cmd, port, logs / f"tito-grpc-{port}.log", engine_env(), start_timeout), f"127.0.0.1:{gport}"


def run(model: str, workloads: list[loadgen.Workload], rounds: int, logs: Path, start_timeout: float,
        transports: tuple[str, ...], inprocess: bool, bare: bool, base: str | None = None,
        tito_args: tuple[str, ...] = ()) -> list[Any]:
    """Rounds of every workload over every transport; with ``base``, the same transports of a second tito from that
    checkout too, named ``base:<transport>`` (both servers stay up; only one is driven at a time)."""
    servers = {"": _start(model, logs, start_timeout, None, tito_args)}
    out: list[dict[str, Any]] = []
    try:
        if base is not None:
            servers["base:"] = _start(model, logs, start_timeout, base, tito_args)
        systems = [(prefix, t) for prefix in servers for t in transports]
        for prefix, t in systems:  # every path warm before anything is measured
            _load(t, servers[prefix][0], servers[prefix][1], bench.WARMUP, logs)
        for r in range(rounds):
            shift = r % len(systems)  # each goes first in turn
            order = systems[shift:] + systems[:shift]
            this: dict[str, Any] = {prefix + t: {} for prefix, t in systems}
            if inprocess:  # the floor, in its own process, while tito idles
                print(f"round {r + 1}/{rounds}: inprocess ...", file=sys.stderr, flush=True)
                this["inprocess"] = bench.run_inprocess(model, workloads, logs, start_timeout + 600.0)
            if bare:
                this |= run_bare(workloads, logs)
            for wl in workloads:
                for prefix, t in order:
                    server, target = servers[prefix]
                    res = this[prefix + t][wl.name] = _load(t, server, target, wl, logs)
                    print(f"round {r + 1}/{rounds} {wl.name:12s} {prefix + t:4s}: {res['tok_s']:8.0f} tok/s "
                          f"{res['req_s']:7.1f} req/s  tito {res['cpu_ms_per_req']:.2f} ms CPU/req  "
                          f"{res['errors']} error(s)", file=sys.stderr, flush=True)
            out.append(this)
    finally:
        for server, _ in servers.values():
            server.stop()
    return out


def added_ratio(rounds: list[dict[str, Any]], wl: str, t: str) -> list[float]:
    """Per round: what transport ``t`` adds to the server's CPU per request above the in-process engine client, over
    what the HTTP route adds (each round's systems ran back to back)."""
    out = []
    for r in rounds:
        try:
            zero = r["inprocess"][wl]["cpu_ms_per_req"]
            # A base server's transports against its own HTTP route.
            http_key = "base:http" if t.startswith("base:") else "http"
            mine, http = r[t][wl]["cpu_ms_per_req"], r[http_key][wl]["cpu_ms_per_req"] - zero
            if not t.startswith("bare"):  # the bare server has no engine client to take off
                mine -= zero
        except (KeyError, TypeError):
            continue
        if http > 0:
            out.append(mine / http)
    return out


def table(rounds: list[dict[str, Any]], workloads: list[loadgen.Workload],
          transports: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    def med(t: str, wl: str, key: str) -> float | None:
        vals = [r[t][wl][key] for r in rounds if t in r and r[t][wl].get(key) is not None]
        return statistics.median(vals) if vals else None

    rows = ["| workload | transport | tok/s | req/s | p50 ms | msgs/req | tito CPU ms/req | adds | "
            "added / HTTP's (range) | client CPU ms/req | errors |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    summary: dict[str, Any] = {}
    systems = (("inprocess",) if any("inprocess" in r for r in rounds) else ()) + transports
    systems += tuple(f"base:{t}" for t in transports if any(f"base:{t}" in r for r in rounds))
    systems += tuple(t for t in ("bare", "bare-stream") if any(t in r for r in rounds))
    for wl in workloads:
        floor = med("inprocess", wl.name, "cpu_ms_per_req")
        for t in systems:
            s: dict[str, Any] = {k: med(t, wl.name, k) for k in ("tok_s", "req_s", "p50_ms", "cpu_ms_per_req",
                                                                  "client_cpu_ms_per_req", "messages_per_req")}
            s["errors"] = sum(r[t][wl.name]["errors"] for r in rounds if t in r)
            cpu = s["cpu_ms_per_req"]
            s["added_ms"] = cpu - floor if t != "inprocess" and cpu is not None and floor is not None else None
            if t.startswith("bare"):  # no engine client beneath: its whole CPU is the transport's
                s["added_ms"] = cpu
            per_round = added_ratio(rounds, wl.name, t) if t not in ("inprocess", "http", "base:http") else []
            s["ratio"] = statistics.median(per_round) if per_round else None
            s["ratio_rounds"] = per_round
            summary.setdefault(wl.name, {})[t] = s
            spread = f" ({min(per_round):.2f}-{max(per_round):.2f})" if per_round else ""
            rows.append(f"| {wl.name} | {t} | {fmt(s['tok_s'])} | {fmt(s['req_s'], 1)} | "
                        f"{fmt(s['p50_ms'], 1)} | {fmt(s['messages_per_req'], 1)} | {fmt(cpu, 2)} | "
                        f"{fmt(s['added_ms'], 2)} | "
                        f"{fmt(s['ratio'], 2)}{spread} | {fmt(s['client_cpu_ms_per_req'], 2)} | {s['errors']} |")
    return "\n".join(rows), summary


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks grpc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Model directory (default: models/tiny-qwen3, written if missing).")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", default=",".join(bench.WORKLOADS),
                   help=f"Comma-separated subset of {','.join(bench.WORKLOADS)}.")
    p.add_argument("--quick", action="store_true", help="A few requests per workload (smoke test).")
    p.add_argument("--out", default="results")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--tito-args", default="",
                   help="Extra flags for the tito servers, e.g. --tito-args='--stream-interval 8'.")
    p.add_argument("--transports", default=",".join(TRANSPORTS),
                   help=f"Comma-separated subset of {','.join(TRANSPORTS)} (http is the reference: always run).")
    p.add_argument("--no-inprocess", action="store_true",
                   help="Skip the in-process floor (then no added CPU or ratios are reported).")
    p.add_argument("--base", default=None,
                   help="A checkout of tito (e.g. /work/main) served beside this one, its transports as base:<name>: "
                        "a change against its base in one run.")
    p.add_argument("--bare", action="store_true",
                   help="Also drive a grpc.aio server with no engine (bare, bare-stream): grpc.aio's own floor.")
    p.add_argument("--_grpc_load", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--_bare_server", type=int, help=argparse.SUPPRESS)
    p.add_argument("--transport", default="grpc", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    ns = p.parse_args(argv)
    if ns._bare_server:  # worker: the bare server, on uvloop as tito's
        import uvloop

        uvloop.install()
        asyncio.run(bare_server(ns._bare_server))
        return 0
    if ns._grpc_load:  # worker: gRPC load generator in its own process, on uvloop like the HTTP one
        import uvloop

        uvloop.install()
        target, spec = ns._grpc_load
        wl = loadgen.Workload(**json.loads(spec))
        c0 = time.process_time()
        if ns.transport == "grpc":
            res = asyncio.run(grpc_load(target, wl))
        else:
            res = asyncio.run(inference_load(target, wl, wl.stream or ns.transport == "inference-stream"))
        res["client_cpu_ms_per_req"] = (time.process_time() - c0) * 1000.0 / max(res["ok"], 1)
        print(json.dumps(res))
        return 0
    unknown = [w for w in ns.workloads.split(",") if w and w not in bench.WORKLOADS]
    unknown += [t for t in ns.transports.split(",") if t and t not in TRANSPORTS]
    if unknown:
        p.error(f"unknown workload or transport: {', '.join(unknown)}")
    transports = tuple(t for t in TRANSPORTS if t == "http" or t in ns.transports.split(","))
    workloads = [bench.WORKLOADS[w].scaled(ns.quick) for w in ns.workloads.split(",") if w]
    model = default_model(ns.model)
    out = Path(ns.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rounds = run(model, workloads, ns.rounds, logs, ns.start_timeout, transports,
                 not ns.no_inprocess, ns.bare, ns.base, tuple(shlex.split(ns.tito_args)))
    text, summary = table(rounds, workloads, transports)
    print(text)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    doc = {"meta": {"time": stamp, "model": model, "rounds": ns.rounds, "quick": ns.quick,
                    "transports": list(transports), "base": ns.base, "tito_args": ns.tito_args,
                    "cpus": os.cpu_count()},
           "summary": summary, "rounds": rounds}
    (out / "bench-grpc.json").write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {out / 'bench-grpc.json'}")
    errors = sum(s["errors"] for row in summary.values() for s in row.values())
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
