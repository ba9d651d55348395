"""tito's HTTP layer alone: the serving process's CPU per request on the fake engine (tests/fake_engine.py), beside a
bare ASGI app that does the same fake work on the same server (uvicorn, uvloop, httptools, as ``tito serve``).

No vLLM engine runs, so this is where a change to the HTTP hot path shows its effect in seconds, and where the engine
is not the limit. The systems, each started fresh every round, rounds interleaved:

    tito   ``create_app(settings, engine=FakeEngine())`` served as ``tito serve`` serves it
    bare   a bare ASGI app: read the body, orjson, the same fake engine, write the answer (the floor of any server
           on this stack: what tito adds is tito minus bare)
    titoxN, barexN   the same on N API processes sharing the port (``--api-server-count``'s layout)

Workloads are the serving benchmark's (benchmarks/serving.py: same requests, same load generator in its own
process). Per workload: req/s and the server's CPU ms per request (all its processes), medians over rounds.

    python -m benchmarks http                       # 3 rounds, tito and bare, all workloads
    python -m benchmarks http --systems tito --workloads 64x1 --rounds 5
    python -m benchmarks http --profile tito --workloads 64x1   # py-spy of the server under that workload
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.clients import Workload, run_load
from benchmarks.probes import Spy, tree_cpu_s
from benchmarks.servers import module_cmd, start

SYSTEMS = ("tito", "bare")


def _workloads() -> dict[str, Workload]:
    from benchmarks.serving import WORKLOADS

    return {k: v for k, v in WORKLOADS.items() if k != "mixed"}


# --------------------------------------------------------------------------------------------------- servers


def _bench_engine() -> Any:
    """The fake engine, minus its call log (it would grow for the whole run)."""
    from tests.fake_engine import FakeEngine

    class BenchEngine(FakeEngine):
        def generate(self, token_ids: list[int], params: Any, request_id: str, *, cache_salt: str | None = None,
                     lora: Any = None, priority: int = 0, data_parallel_rank: int | None = None,
                     prompt: Any = None) -> Any:
            return self._run(token_ids, params, request_id)

    return BenchEngine()


def bare_app(engine: Any) -> Any:
    """The least a server can do for the same request: no checks, no metrics, the answer's tokens only."""
    from types import SimpleNamespace

    import orjson

    delta = SimpleNamespace(output_kind=SimpleNamespace(name="DELTA"))
    final = SimpleNamespace(output_kind=SimpleNamespace(name="FINAL_ONLY"))
    json_head = [(b"content-type", b"application/json")]
    sse_head = [(b"content-type", b"text/event-stream; charset=utf-8")]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": json_head})
            await send({"type": "http.response.body", "body": b'{"status":"ok"}'})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        req = orjson.loads(body)
        sp = req["sampling_params"]
        stream = bool(req.get("stream"))
        params = delta if stream else final
        params = SimpleNamespace(output_kind=params.output_kind, n=1, max_tokens=sp["max_tokens"])
        gen = engine.generate(req["token_ids"], params, "bare")
        if stream:
            await send({"type": "http.response.start", "status": 200, "headers": sse_head})
            async for out in gen:
                ev = b"data: " + orjson.dumps({"choices": [{"token_ids": out.outputs[0].token_ids}]}) + b"\n\n"
                await send({"type": "http.response.body", "body": ev, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        last = None
        async for out in gen:
            last = out
        assert last is not None
        data = orjson.dumps({"choices": [{"token_ids": last.outputs[0].token_ids}]})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*json_head, (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return app


def serve_main(system: str, port: int, extra: list[str], api_servers: int = 1) -> int:
    """Run in the server process: build the app on the fake engine and serve it like ``tito serve`` does. With
    ``api_servers`` > 1 this process binds the port and that many API processes serve it (each with its own fake
    engine: the engine is not what is measured), as ``vllm serve --api-server-count`` shares its socket."""
    import socket

    if api_servers <= 1:
        _serve(system, port, extra, None)
        return 0
    import multiprocessing

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(2048)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_serve, args=(system, port, extra, sock), name=f"api-{i}") for i in range(api_servers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    return 0


def _serve(system: str, port: int, extra: list[str], sock: Any) -> None:
    import uvicorn
    import vllm.sampling_params  # noqa: F401 - imported once the real engine is up; never inside a measured request

    from tito.main import create_app

    engine = _bench_engine()
    if system == "bare":
        app = bare_app(engine)
    else:
        argv = ["--model", "/models/fake", "--port", str(port), "--warmup", "false", *extra]
        from app.engine.vllm_args import parse_serve

        app = create_app(parse_serve(argv), engine=engine)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning",
                            access_log=False, timeout_keep_alive=120)
    uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)


# --------------------------------------------------------------------------------------------------- driver


def run_system(system: str, workloads: list[Workload], logs: Path, extra: list[str],
               profile: str | None = None) -> dict[str, Any]:
    from benchmarks.serving import WARMUP
    from tests.helpers import engine_env, free_port

    port = free_port()
    name, _, n = system.partition("x")  # "titox2": tito on 2 API processes
    cmd = module_cmd("benchmarks.http_layer", "--_serve", name, str(port), "--extra", json.dumps(extra),
                     "--api-servers", n or "1")
    server = start(cmd, port, logs / f"http-{system}-{port}.log", engine_env(), 120)
    results: dict[str, Any] = {}
    try:
        run_load(server.url, WARMUP, logs / "http-load.log")
        for wl in workloads:
            out = logs / f"profile-{system}-{wl.name}-{time.strftime('%H%M%S')}.txt"
            with Spy(server.proc.pid, out, rate=200) if profile else contextlib.nullcontext():
                c0 = tree_cpu_s(server.proc.pid)
                res = run_load(server.url, wl, logs / "http-load.log")
                cpu = tree_cpu_s(server.proc.pid) - c0
            if profile:
                res["profile"] = str(out)
            res["cpu_ms_per_req"] = cpu * 1000.0 / max(res["ok"], 1)
            results[wl.name] = res
    finally:
        server.stop()
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks http", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--workloads", default="64x64,stream64x64,64x1,1x1")
    p.add_argument("--tito-args", default="", help="Extra `tito serve` flags for the tito system.")
    p.add_argument("--profile", default=None, help="py-spy the server of this system during each workload.")
    p.add_argument("--out", default="results")
    p.add_argument("--_serve", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--extra", default="[]", help=argparse.SUPPRESS)
    p.add_argument("--api-servers", type=int, default=1, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    if ns._serve:
        return serve_main(ns._serve[0], int(ns._serve[1]), json.loads(ns.extra), ns.api_servers)

    import shlex

    all_wl = _workloads()
    workloads = [all_wl[w] for w in ns.workloads.split(",") if w]
    systems = [s for s in ns.systems.split(",") if s]
    logs = Path(ns.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, Any]] = []
    for r in range(ns.rounds):
        this = {}
        for s in systems:
            this[s] = run_system(s, workloads, logs, shlex.split(ns.tito_args) if s.startswith("tito") else [],
                                 ns.profile if ns.profile == s else None)
            print(f"round {r + 1}/{ns.rounds} {s}: " + ", ".join(
                f"{w.name} {this[s][w.name]['cpu_ms_per_req']:.3f} ms/req {this[s][w.name]['req_s']:.0f} req/s"
                + (f" ({this[s][w.name]['errors']} errors)" if this[s][w.name]["errors"] else "")
                for w in workloads), file=sys.stderr, flush=True)
        rounds.append(this)
    print(f"\nserver CPU ms/request on the fake engine (median of {ns.rounds}; load average "
          f"{os.getloadavg()[0]:.1f}):")
    print(f"{'workload':<12} " + " ".join(f"{s + ' ms':>10} {s + ' req/s':>11}" for s in systems)
          + ("   tito - bare" if {"tito", "bare"} <= set(systems) else ""))
    summary: dict[str, Any] = {}
    for wl in workloads:
        row = {s: {k: statistics.median(rr[s][wl.name][k] for rr in rounds) for k in ("cpu_ms_per_req", "req_s")}
               for s in systems}
        summary[wl.name] = row
        line = f"{wl.name:<12} " + " ".join(f"{row[s]['cpu_ms_per_req']:>10.3f} {row[s]['req_s']:>11.0f}"
                                            for s in systems)
        if "tito" in row and "bare" in row:
            line += f"   {row['tito']['cpu_ms_per_req'] - row['bare']['cpu_ms_per_req']:+.3f}"
        print(line)
    (Path(ns.out) / "bench_http.json").write_text(json.dumps({"summary": summary, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
