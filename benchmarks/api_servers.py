"""Several API processes: tito against vLLM's own server at the same ``--api-server-count``, on the tiny model (where
the API processes, not the engine, are the bottleneck).

Each round starts every system fresh, one at a time, in an order that is reversed every other round, and drives the
same cases through each; the report gives every figure's spread over rounds (min / median / max) and the ratios of
tito to vLLM taken round by round.

    tito<N>   ``tito serve --api-server-count N``
    vllm<N>   vLLM's ``vllm serve --api-server-count N`` (its serve command's own path: ``run_multi_api_server``
              for N > 1), with ``--enable-scale-out`` for the token route

Cases (closed loop, C clients each sending its next request as soon as the last one answered; 16 prompt tokens, 64
new tokens, ``ignore_eos``; a warm-up of C requests first, not measured):

    gen-C     the token route ``/inference/v1/generate``, JSON answers
    cmpl-C    ``/v1/completions`` with token-id prompts, streamed (SSE; tokens counted from the final usage chunk)

for C in ``--clients`` (default 64,256). Measured: output tokens/s, and the CPU per request of the server's API side
(every process of the server but the engine core, its workers and the DP coordinator: tito's API processes and its
control process, vLLM's API servers and their supervisor). The load generator is tito's lean one
(benchmarks/clients.py) in a process of its own, sharing the machine.

Each round holds the machine's exclusive lock (``--lock``; COORDINATION.md) and lets go of it between rounds.

    python -m benchmarks api_servers --rounds 3                      # tito1, tito2, vllm1, vllm2; 64 and 256
    python -m benchmarks api_servers --systems tito2,vllm2 --clients 256 --rounds 1
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.clients import Workload, request_spec, sse_events
from benchmarks.probes import cpu_seconds, descendants
from benchmarks.report import fmt, spread, write
from benchmarks.servers import (
    NAME,
    default_model,
    module_cmd,
    port_in,
    reverse_odd,
    run_json,
    server_cmd,
    start,
    vllm_serve_cmd,
)

SYSTEMS = ("tito1", "tito2", "vllm1", "vllm2")
NEW_TOKENS, PROMPT = 64, 16
CMPL_PATH = "/v1/completions"
# The engine's processes (not the API's), by the titles vLLM gives them.
ENGINE_TITLES = ("EngineCore", "VLLM::Worker", "VllmWorker", "DPCoordinator", "VLLM::DPCoord")


@dataclass(frozen=True)
class Case:
    name: str
    clients: int
    stream: bool  # cmpl: streamed /v1/completions; gen: the token route, JSON
    requests: int

    def workload(self) -> Workload:
        return Workload(self.name, self.clients, NEW_TOKENS, self.stream, self.requests, "tok/s", PROMPT)


def cases(clients: list[int], per_client: int) -> list[Case]:
    return [Case(f"{kind}-{c}", c, kind == "cmpl", c * per_client) for kind in ("gen", "cmpl") for c in clients]


# --------------------------------------------------------------------------------------------------- load


def _completion_bodies(wl: Workload) -> list[bytes]:
    import orjson

    out = []
    for i in range(wl.requests):
        prompt, mt = request_spec(wl, i)
        out.append(orjson.dumps({"model": NAME, "prompt": prompt, "max_tokens": mt, "temperature": 1.0,
                                 "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}))
    return out


def _completion_tokens(body: bytes) -> int:
    events, done = sse_events(body)
    if not done:
        raise RuntimeError("stream ended without [DONE]")
    for ev in events:
        if "error" in ev:
            raise RuntimeError(f"error event: {ev['error']}")
    usage = next((ev["usage"] for ev in reversed(events) if ev.get("usage")), None)
    if usage is None:
        raise RuntimeError("no usage chunk")
    return int(usage["completion_tokens"])


async def completions_load(url: str, wl: Workload) -> dict[str, Any]:
    """The lean load generator (benchmarks/clients.py) on streamed ``/v1/completions``."""
    from benchmarks.clients import raw_http_load

    return await raw_http_load(url, wl, CMPL_PATH, _completion_bodies(wl), _completion_tokens)


def _load(url: str, case: Case, logs: Path) -> dict[str, Any]:
    """One case from the load generator in a process of its own (this session)."""
    from tests.helpers import engine_env

    cmd = module_cmd("benchmarks.api_servers", "--_load", url, json.dumps(asdict(case)))
    return run_json(cmd, 900.0, logs / "load.log", engine_env())[0]


def _load_main(url: str, case_json: str) -> int:
    import uvloop

    from benchmarks.clients import raw_load

    case = Case(**json.loads(case_json))
    run = completions_load if case.stream else raw_load

    async def measured() -> dict[str, Any]:
        t0 = time.process_time()
        res = await run(url, case.workload())
        res["client_cpu_ms_per_req"] = (time.process_time() - t0) * 1000 / max(1, res["ok"])
        return res

    print(json.dumps(uvloop.run(measured())))
    return 0


# --------------------------------------------------------------------------------------------------- servers


def system_cmd(system: str, model: str, port: int, extra: str) -> list[str]:
    kind, n = system.rstrip("0123456789"), int(system[len(system.rstrip("0123456789")):] or 1)
    cmd = server_cmd("vllm" if kind == "vllm" else "tito", model, port, defaults=False, extra=extra)
    cmd += ["--api-server-count", str(n)]
    if kind == "vllm":
        cmd = vllm_serve_cmd(cmd[3:], "--enable-scale-out")
    return cmd


def api_pids(root: int) -> list[int]:
    """The server's processes on the API side: the root and every descendant that is not an engine process."""
    out = [root]
    for pid in descendants(root):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if not any(t in title or t in comm for t in ENGINE_TITLES):
            out.append(pid)
    return out


@contextlib.contextmanager
def machine_lock(path: str) -> Iterator[None]:
    """The machine's exclusive lock for one round (COORDINATION.md), released between rounds."""
    if path == "none":
        yield
        return
    with open(path, "a") as f:
        t0 = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_EX)
        print(f"exclusive lock taken after {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_system(system: str, ns: argparse.Namespace, model: str, all_cases: list[Case], logs: Path
               ) -> dict[str, Any]:
    from tests.helpers import engine_env

    port = port_in(ns.port_range)
    cmd = system_cmd(system, model, port, ns.tito_args if system.startswith("tito") else ns.vllm_args)
    server = start(cmd, port, logs / f"{system}.log", env=engine_env(), timeout=ns.start_timeout)
    try:
        assert server.proc is not None
        pids = api_pids(server.proc.pid)
        out: dict[str, Any] = {"api_pids": len(pids)}
        for case in all_cases:
            # The cold paths first, outside the measurement: each API process's first requests of a route (tito
            # builds vLLM's OpenAI layer at the first /v1 request, seconds of imports).
            _load(server.url, Case(case.name + "-warm", case.clients, case.stream, case.clients), logs)
            before = cpu_seconds(api_pids(server.proc.pid))
            res = _load(server.url, case, logs)
            res["api_cpu_ms_per_req"] = (cpu_seconds(api_pids(server.proc.pid)) - before) * 1000 / max(1, res["ok"])
            out[case.name] = res
            print(f"  {system} {case.name}: {res['tok_s']:.0f} tok/s, API CPU {res['api_cpu_ms_per_req']:.2f} "
                  f"ms/req, {res['errors']} errors", file=sys.stderr, flush=True)
        return out
    finally:
        server.kill()


# --------------------------------------------------------------------------------------------------- report


def report(rounds: list[dict[str, Any]], systems: list[str], all_cases: list[Case]) -> str:
    lines = ["| case | system | tok/s | API CPU ms/req | tito/vLLM tok/s | tito/vLLM CPU | errors |",
             "|---|---|---|---|---|---|---|"]
    for case in all_cases:
        for system in systems:
            got = [r[system][case.name] for r in rounds if system in r]
            tok = [g["tok_s"] for g in got]
            cpu = [g["api_cpu_ms_per_req"] for g in got]
            ratio_tok = ratio_cpu = "–"
            other = system.replace("tito", "vllm")
            if system.startswith("tito") and other in systems:
                pairs = [(r[system][case.name], r[other][case.name]) for r in rounds if system in r and other in r]
                ratio_tok = spread([a["tok_s"] / b["tok_s"] for a, b in pairs if b["tok_s"]])
                ratio_cpu = spread([a["api_cpu_ms_per_req"] / b["api_cpu_ms_per_req"] for a, b in pairs
                                    if b["api_cpu_ms_per_req"]])
            lines.append(f"| {case.name} | {system} | {spread(tok, '{:.0f}')} | {spread(cpu)} | {ratio_tok} | "
                         f"{ratio_cpu} | {sum(g['errors'] for g in got)} |")
    return "\n".join(lines)


def ceiling(rounds: list[dict[str, Any]], system: str, case: str) -> dict[str, float] | None:
    """What one API process sustains at one full core, from the median API CPU per request of ``case`` on a
    one-process ``system``: requests/s and output tokens/s."""
    cpu = [r[system][case]["api_cpu_ms_per_req"] for r in rounds if system in r and case in r[system]]
    if not cpu:
        return None
    ms = statistics.median(cpu)
    return {"cpu_ms_per_req": ms, "req_s": 1000 / ms, "tok_s": 1000 / ms * NEW_TOKENS}


# --------------------------------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks api_servers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Model directory (default: models/tiny-qwen3, written if missing).")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="Comma-separated: tito<N> and vllm<N>.")
    p.add_argument("--clients", default="64,256", help="Concurrent clients of each case (comma-separated).")
    p.add_argument("--per-client", type=int, default=4, help="Requests per client in a case (default 4).")
    p.add_argument("--out", default="results", help="Folder for api_servers.json (default results/).")
    p.add_argument("--lock", default="/tmp/tito-machine.lock", help="The machine lock each round holds exclusively "
                   "(`none`: no lock).")
    p.add_argument("--tito-args", default="", help="Extra flags for tito.")
    p.add_argument("--vllm-args", default="", help="Extra flags for vLLM's server.")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--port-range", type=lambda v: tuple(map(int, v.split("-"))), default=None)
    p.add_argument("--_load", nargs=2, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    if ns._load:
        return _load_main(*ns._load)
    model = default_model(ns.model)
    systems = ns.systems.split(",")
    all_cases = cases([int(c) for c in ns.clients.split(",")], ns.per_client)
    out = Path(ns.out)
    logs = out / "api_servers-logs"
    logs.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, Any]] = []
    for r in range(ns.rounds):
        with machine_lock(ns.lock):
            got: dict[str, Any] = {}
            for system in reverse_odd(systems, r):
                print(f"round {r + 1}/{ns.rounds}: {system}", file=sys.stderr, flush=True)
                got[system] = run_system(system, ns, model, all_cases, logs)
            rounds.append(got)
        write(out, "api_servers", {"systems": systems, "cases": [asdict(c) for c in all_cases], "rounds": rounds,
                                   "new_tokens": NEW_TOKENS, "prompt": PROMPT})
    print(report(rounds, systems, all_cases))
    for case in ("gen-64", "cmpl-64"):
        c = ceiling(rounds, "tito1", case)
        if c is not None:
            print(f"one tito API process at one full core, {case}: {fmt(c['req_s'])} req/s, {fmt(c['tok_s'])} tok/s "
                  f"({c['cpu_ms_per_req']:.2f} ms of CPU per request of {NEW_TOKENS} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
