"""Benchmark tito against the engine in-process and against vLLM's own ``--tokens-only`` server.

Round after round, each system is started fresh on the same model and engine settings, one at a time (so they never
share the CPU), and driven through the same workloads:

    inprocess  vLLM's AsyncLLM in one process, no HTTP (the ceiling)
    tito       ``python -m tito serve``
    base       tito from another checkout or commit (``--base DIR|COMMIT``, e.g. ``--base HEAD~1``): a change
               against its base in one run, the two started from their own trees, in alternating order round by
               round; the report adds each figure's spread (min / median / max over rounds) and the per-round
               ratios of tito to base
    vllm       ``python -m vllm.entrypoints.openai.api_server --tokens-only``
    matched    inprocess again, beside a CPU burner as large as the CPU tito's HTTP layer and load generator took in
               the same round (per workload): the ceiling for any HTTP server on this machine. On a 2-core machine
               the engine's processes already use both cores, so tito/matched separates what tito costs from what
               the machine lacks.

Workloads (closed loop: C clients each send their next request as soon as the last one answered):

    64x64        64 clients, 64 new tokens each                -> tok/s
    stream64x64  the same, streamed (SSE)                      -> tok/s
    64x1         64 clients, 1 new token                       -> req/s
    1x1          1 client, 1 new token                         -> p50 latency
    mixed        32 clients, prompt 8-256 and 1-128 new tokens -> tok/s

Every non-200 answer, error event, transport failure or answer shorter than ``max_tokens`` (requests use
``ignore_eos``) counts as an error, including during the cold warm-up right after start.

For HTTP systems the load generator is a separate process (a bare asyncio protocol with httptools on uvloop, one
keep-alive connection per client; ``--client aiohttp`` for the older, costlier one), so it does not share the server's
event loop; on a 2-core machine it still shares the CPU, and reports its own CPU per request. Server, engine and load
generator stay in this process's session: a session is a CFS autogroup, and separate groups would split the CPU
between them in halves.

Results: a table on stdout (medians over rounds; ratios of tito to inprocess, vllm and matched, CPU per request of
the serving process and of the load generator), ``bench-<time>.json`` and ``bench.json`` plus ``bench.png``
(throughput and latency by workload) under ``--out``, and the resident memory (RSS, USS) of each server process next
to its engine processes, with tito's own share.

    python -m benchmarks serving                          # 3 rounds, all systems, all workloads (make bench)
    python -m benchmarks serving --base main --rounds 5   # the working tree against main (make bench BASE=main)
    python -m benchmarks serving --quick --rounds 1 --systems inprocess,tito   # a one-minute smoke
    ... --tito-url http://127.0.0.1:8000 --tito-pid 1234   # drive a tito already running (tests/test_bench_smoke.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import select
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.clients import CLIENTS, Workload, closed_loop, request_spec, run_load, sampling, with_cpu
from benchmarks.probes import RssSampler, process_cpu_s
from benchmarks.servers import (
    MAX_MODEL_LEN,
    ROOT,
    alternate,
    base_tree,
    default_model,
    from_checkout,
    kill_group,
    module_cmd,
    start,
)
from benchmarks.serving_report import build_summary, print_table, write_chart

SYSTEMS = ("inprocess", "tito", "base", "vllm", "matched")

WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("64x64", 64, 64, False, 512, "tok/s"),
    Workload("stream64x64", 64, 64, True, 512, "tok/s"),
    Workload("64x1", 64, 1, False, 2048, "req/s"),
    Workload("1x1", 1, 1, False, 300, "p50"),
    Workload("mixed", 32, 0, False, 256, "tok/s"),
)}
WARMUP = Workload("warmup", 4, 4, False, 8, "req/s")


# --------------------------------------------------------------------------------------------------- in-process


async def inprocess_load(engine: Any, wl: Workload) -> dict[str, Any]:
    from vllm.inputs import tokens_input
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    # The output kind a server asks for (final only for a JSON answer, deltas for a stream), and skip_clone as vLLM's
    # own OpenAI layer and tito set it on params made for one request: the floor is the engine client at its best,
    # so "added" is what a server costs beyond it (vLLM's tokens route deep-copies its params: part of its added).
    kind = RequestOutputKind.DELTA if wl.stream else RequestOutputKind.FINAL_ONLY

    async def send(_: int, i: int) -> int:
        prompt, mt = request_spec(wl, i)
        params = SamplingParams(**sampling(mt), output_kind=kind, skip_clone=True)
        got = 0
        async for out in engine.llm.generate(tokens_input(prompt), params, f"bench-{wl.name}-{i}-{time.time_ns()}"):
            n = sum(len(o.token_ids) for o in out.outputs)
            got = got + n if wl.stream else n
        return got

    return await closed_loop(wl, send)


_BURNER = """
import sys, time
busy, period = float(sys.argv[1]) * 0.01, 0.01
sys.stdout.write("b")  # burning from now on (past interpreter start-up)
sys.stdout.close()
while True:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < busy:
        pass
    time.sleep(period - busy)
"""


class Burner:
    """Keeps ``cores`` worth of CPU busy (processes duty-cycled over 10 ms periods) while the ``with`` block runs."""

    def __init__(self, cores: float) -> None:
        self.cores = max(0.0, min(cores, float(os.cpu_count() or 1)))  # never more than the machine has
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Burner:
        left = self.cores
        while left > 0.01:
            share = min(left, 1.0)
            self.procs.append(subprocess.Popen([sys.executable, "-c", _BURNER, f"{min(share, 0.999):.3f}"],
                                               stdout=subprocess.PIPE))
            left -= share
        for p in self.procs:  # the block starts once every burner burns, not during their interpreters' start-up
            assert p.stdout is not None
            ready, _, _ = select.select([p.stdout], [], [], 60)
            if not ready or p.stdout.read(1) != b"b":
                self.__exit__()
                raise RuntimeError("a CPU burner did not start")
            p.stdout.close()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait(10)


def extra_cores(tito: dict[str, Any], inprocess: dict[str, Any]) -> float:
    """The CPU tito's HTTP layer and its load generator added, in cores, at tito's rate: (tito's serving-process
    CPU per request - the in-process client's + the load generator's) x tito's requests per second."""
    extra_ms = tito["cpu_ms_per_req"] - inprocess["cpu_ms_per_req"] + tito.get("client_cpu_ms_per_req", 0.0)
    return max(0.0, extra_ms * tito["req_s"] / 1000.0)


def inprocess_main(model: str, workloads: list[Workload], burn: dict[str, float] | None = None) -> dict[str, Any]:
    """Run in the worker process: start the engine like tito does (same settings), run the workloads. With ``burn``
    (the ``matched`` system), each workload runs beside a :class:`Burner` of that many cores."""
    from app.core.settings import Settings
    from app.engine.adapter import Engine

    settings = Settings(model=model, dtype="float32", max_model_len=MAX_MODEL_LEN, warmup=True)

    async def run() -> dict[str, Any]:
        engine = Engine.start(settings)
        try:
            await engine.warmup()  # what tito does before it reports healthy
            results = {"warmup": await inprocess_load(engine, WARMUP)}
            for wl in workloads:
                with Burner((burn or {}).get(wl.name, 0.0)):
                    c0 = process_cpu_s()
                    results[wl.name] = with_cpu(await inprocess_load(engine, wl), process_cpu_s() - c0)
                if burn is not None:
                    results[wl.name]["burned_cores"] = burn.get(wl.name, 0.0)
            import psutil

            # Its own USS, now: the driver cannot read it once this process has exited.
            results["uss_mb"] = psutil.Process().memory_full_info().uss / 2**20
            return results
        finally:
            engine.shutdown()

    return asyncio.run(run())


# --------------------------------------------------------------------------------------------------- driver


def run_inprocess(model: str, workloads: list[Workload], logs: Path, timeout: float,
                  burn: dict[str, float] | None = None) -> dict[str, Any]:
    from tests.helpers import engine_env

    env = engine_env()
    spec = json.dumps({"workloads": [asdict(w) for w in workloads], "burn": burn})
    log_path = logs / "inprocess.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(module_cmd("benchmarks.serving", "--_inprocess", model, spec), stdout=subprocess.PIPE,
                                stderr=log, env=env, cwd=str(ROOT), process_group=0)
        with RssSampler(proc.pid) as rss:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                raise RuntimeError(f"in-process run timed out after {timeout:.0f}s; see {log_path}") from None
    kill_group(proc)  # leftovers of the group, if any
    if proc.returncode != 0:
        raise RuntimeError(f"in-process run failed ({proc.returncode}); see {log_path}")
    results: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    results["memory"] = {**rss.result(), "server_uss_mb": results.pop("uss_mb", 0.0)}
    return results


def run_server(system: str, model: str, workloads: list[Workload], logs: Path, timeout: float,
               client: str, tito_args: tuple[str, ...] = (), running: tuple[str, int] | None = None,
               base: str | None = None) -> dict[str, Any]:
    """Start ``system``'s server, drive it through the workloads, stop it. With ``running`` (URL, pid): drive that
    server, already up, instead (not started, not stopped; no ``start_s``)."""
    from tests.helpers import engine_env, free_port, tito_cmd, vllm_cmd

    if running is not None:
        url, pid = running
        return _drive(url, pid, workloads, logs, timeout, client, {})
    port = free_port()
    if system in ("tito", "base"):
        cmd = tito_cmd(model, port, "--max-model-len", str(MAX_MODEL_LEN), *tito_args)
        if system == "base":  # the same command, importing tito from the other checkout
            assert base is not None
            cmd = from_checkout(cmd, base)
    else:
        cmd = vllm_cmd(model, port)
    t0 = time.monotonic()
    server = start(cmd, port, logs / f"{system}-{port}.log", engine_env(), timeout)
    try:
        return _drive(server.url, server.proc.pid, workloads, logs, timeout, client,
                      {"start_s": time.monotonic() - t0})
    finally:
        server.stop()


def _drive(url: str, pid: int, workloads: list[Workload], logs: Path, timeout: float, client: str,
           results: dict[str, Any]) -> dict[str, Any]:
    """The warm-up and the workloads against a running server (process ``pid``), each from a load generator process;
    the server's CPU per request and its memory (and its engine's) next to the results."""
    with RssSampler(pid) as rss:
        for wl in [WARMUP, *workloads]:
            c0 = process_cpu_s(pid)
            res = run_load(url, wl, logs / "load.log", client, timeout)
            results[wl.name] = with_cpu(res, process_cpu_s(pid) - c0)
    results["memory"] = rss.result()
    return results



def run_round(r: int, ns: argparse.Namespace, systems: list[str], model: str, workloads: list[Workload],
              logs: Path, out: Path, rounds: list[dict[str, Any]], base: str | None) -> dict[str, Any]:
    this: dict[str, Any] = {}
    for s in systems:
        t0 = time.monotonic()
        print(f"round {r + 1}/{ns.rounds}: {s} ...", file=sys.stderr, flush=True)
        timeout = ns.start_timeout + 600.0
        if s == "inprocess":
            this[s] = run_inprocess(model, workloads, logs, timeout)
        elif s == "matched":
            burn = {wl.name: extra_cores(this["tito"][wl.name], this["inprocess"][wl.name]) for wl in workloads}
            this[s] = run_inprocess(model, workloads, logs, timeout, burn)
        else:
            running = (ns.tito_url.rstrip("/"), ns.tito_pid) if s == "tito" and ns.tito_url else None
            this[s] = run_server(s, model, workloads, logs, ns.start_timeout, ns.client,
                                 tuple(shlex.split(ns.tito_args)), running, base)
        # Every system's figures as soon as it is done: a later failure (a server that never starts) loses none.
        (out / "bench-partial.json").write_text(json.dumps({"rounds": [*rounds, this]}, indent=1))
        errs = sum(v["errors"] for k, v in this[s].items() if isinstance(v, dict) and "errors" in v)
        print(f"round {r + 1}/{ns.rounds}: {s} done in {time.monotonic() - t0:.0f}s, {errs} error(s)",
              file=sys.stderr, flush=True)
    return this


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="Model directory (default: models/tiny-qwen3, written if missing).")
    p.add_argument("--rounds", type=int, default=3, help="Rounds; every system starts fresh each round (default 3).")
    p.add_argument("--systems", default=None,
                   help=f"Comma-separated subset of {','.join(SYSTEMS)} (default: all; base only with --base).")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"Comma-separated subset of {','.join(WORKLOADS)}.")
    p.add_argument("--quick", action="store_true", help="A few requests per workload (smoke test, not a measurement).")
    p.add_argument("--out", default="results", help="Folder for bench.json / bench.png (default results/).")
    p.add_argument("--start-timeout", type=float, default=300.0, help="Seconds a system may take to start.")
    p.add_argument("--client", choices=sorted(CLIENTS), default="raw",
                   help="HTTP load generator: raw (default; a bare asyncio protocol with httptools, the cheapest) or "
                        "aiohttp (for comparison).")
    p.add_argument("--tito-args", default="",
                   help="Extra flags for tito's server, e.g. --tito-args='--stream-interval 4'.")
    p.add_argument("--tito-url", default=None,
                   help="Drive the tito server already running at this URL (started on --model with max_model_len "
                        f"{MAX_MODEL_LEN}) instead of starting one each round; needs --tito-pid. For the smoke test, "
                        "which has one up: not a measurement (the server is not fresh, nor alone on the machine).")
    p.add_argument("--base", default=None,
                   help="A checkout of tito (e.g. /work/main) or a commit of this repository (e.g. main, HEAD~1), "
                        "served as the 'base' system, with --tito-args too.")
    p.add_argument("--tito-pid", type=int, default=None,
                   help="The process id of the --tito-url server (its CPU and memory, and its engine's).")
    p.add_argument("--vllm-bench", action="store_true", help="tito against vLLM's server under vLLM's own benchmark "
                   "client, streamed /v1/completions (benchmarks/serving_vllm.py); with --defaults, --update, --cases.")
    p.add_argument("--defaults", action="store_true", help="--vllm-bench: each server at its defaults.")
    p.add_argument("--update", action="store_true", help="--vllm-bench: also a full weight update on tito.")
    p.add_argument("--cases", default="c16", help="--vllm-bench: comma-separated subset of c16,c16-many,c64,c16-long, "
                   "c16-chat (vLLM's client: /v1/completions, /v1/chat/completions) or of t16,t16-stream (the token "
                   "route, tito's load generator).")
    p.add_argument("--vllm-args", default="", help="--vllm-bench: extra flags for vLLM's server, e.g. "
                   "--vllm-args=--enforce-eager.")
    p.add_argument("--port-range", type=lambda v: tuple(map(int, v.split("-"))), default=None, help="e.g. 18000-18999")
    p.add_argument("--_inprocess", nargs=2, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    ns = p.parse_args(argv)
    if ns._inprocess:  # worker: the engine in-process, on uvloop as tito's server runs
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        from app.engine.process_start import reexec_with_preload

        reexec_with_preload("fork")  # as `tito serve` does: the engine's processes forked, not spawned
        model, spec = ns._inprocess
        job = json.loads(spec)
        print(json.dumps(inprocess_main(model, [Workload(**w) for w in job["workloads"]], job["burn"])))
        return 0

    if ns.vllm_bench:
        from benchmarks.serving_vllm import main as vllm_main

        return vllm_main(ns, default_model(ns.model))
    systems = [s for s in (ns.systems or ",".join(x for x in SYSTEMS if x != "base" or ns.base)).split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS] + [w for w in ns.workloads.split(",") if w and w not in WORKLOADS]
    if bad:
        p.error(f"unknown system/workload: {', '.join(bad)}")
    if ("base" in systems) != (ns.base is not None):
        p.error("the base system and --base DIR go together")
    if (ns.tito_url is None) != (ns.tito_pid is None):
        p.error("--tito-url and --tito-pid go together")
    if ns.tito_url and ns.tito_args:
        p.error("--tito-args starts tito with those flags; a --tito-url server is already running")
    if "matched" in systems:
        if not {"inprocess", "tito"} <= set(systems):
            p.error("the matched system needs inprocess and tito in the same run (it burns what tito added)")
        systems = [x for x in systems if x != "matched"] + ["matched"]  # last: it reads this round's tito figures
    workloads = [WORKLOADS[w].scaled(ns.quick) for w in ns.workloads.split(",") if w]
    model = default_model(ns.model)
    out = Path(ns.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    base, exported = base_tree(ns.base) if ns.base else (None, None)
    rounds: list[dict[str, Any]] = []
    try:
        for r in range(ns.rounds):
            rounds.append(run_round(r, ns, alternate(systems, r), model, workloads, logs, out, rounds, base))
    finally:
        if exported:
            shutil.rmtree(exported, ignore_errors=True)

    summary = build_summary(rounds, systems, workloads)
    print_table(summary, systems, workloads, ns.rounds)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    meta = {"time": stamp, "model": model, "rounds": ns.rounds, "quick": ns.quick, "systems": systems,
            "client": ns.client, "tito_args": ns.tito_args, "tito_url": ns.tito_url, "base": ns.base,
            "workloads": [asdict(w) for w in workloads], "cpus": os.cpu_count(), "python": platform.python_version(),
            "machine": platform.machine(), "max_model_len": MAX_MODEL_LEN}
    doc = {"meta": meta, "summary": summary, "rounds": rounds}
    text = json.dumps(doc, indent=2)
    (out / f"bench-{stamp}.json").write_text(text)
    (out / "bench.json").write_text(text)
    chart = write_chart(out / "bench.png", summary, systems, workloads)
    print(f"\nwrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if chart else ""))
    total_errors = sum(v["errors"] for row in summary["workloads"].values() for k, v in row.items()
                       if isinstance(v, dict) and "errors" in v) + sum(summary["cold_errors"].values())
    return 1 if total_errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
