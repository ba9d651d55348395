"""Direct vs the Dynamo sidecar path: the same token requests sent to one tito replica's HTTP API, and through Dynamo's
frontend → Dynamo's vLLM sidecar → tito's ``vllm.Inference`` (gRPC) on the same replica.

    python -m benchmarks dynamo --model models/tiny-qwen3 [--requests 200] [--clients 1,8] [--max-tokens 16]
        [--rounds 2] [--vllm-bench] [--tito-args="--stream-interval 4"] [--paths direct,sidecar] [--warmup 3]
    python -m benchmarks dynamo --model models/qwen3-0.6b --dtype bfloat16 --max-model-len 4096 \
        --tito-args=--enforce-eager --clients 16 --max-tokens 64 --requests 64 --warmup 1   # a real shape

Starts one tito (``--grpc-port``), Dynamo's vLLM sidecar by hand (``python -m dynamo.vllm.sidecar``) and Dynamo's
frontend (file discovery in a temporary directory, everything on loopback), then drives closed-loop clients in
alternating rounds: ``direct`` posts token ids to tito's ``/inference/v1/generate``; ``sidecar`` posts the same body
to the frontend's ``/inference/v1/generate`` (Dynamo's token route: no tokenizing on the way in); ``completions``
posts the same ids as a token prompt to the frontend's ``/v1/completions`` (text comes back: tito detokenizes for
the sidecar), the seed's path; ``direct-completions`` the same body to tito's own ``/v1/completions``. ``ignore_eos``:
the same number of tokens out every time. Reports p50/p99 latency, tokens/s, the p50 the path adds, the CPU per
request of the frontend, the sidecar and tito's own process (from /proc: they move much less than latencies on a
shared machine), and each path's tokens/s and tito CPU as ratios to the direct route of the same API taken in the
same round (min / median / max over rounds: the spread tells a change from the machine's noise). The engine's
CPU per request (tito's child processes: the EngineCore) is reported beside them: at a real shape it is most of the
machine, and what the frontend and the sidecar spend is taken from it. ``--paths`` runs a subset of the paths (each
with its direct route); ``--paths ""`` with ``--vllm-bench``: vLLM's client alone. ``--profile DIR``: py-spy
(``--native``, idle frames left out) records the frontend, the sidecar and tito through each path of the first round,
one collapsed-stack file per path and process (py-spy's own CPU then falls on the measured run: profile in a run of
its own).
``--vllm-bench`` adds vLLM's own benchmark client (``vllm bench serve``: random 32-token text prompts, streamed
``/v1/completions``) on tito's route and on the frontend's, in alternating rounds. Needs the ``dynamo`` extra and
``ai-dynamo`` (see docs/guides/dynamo.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from app.dynamo.sidecar import free_system_port
from benchmarks.clients import vllm_bench as vllm_client
from benchmarks.probes import Spy, cpu_seconds, descendants, thread_cpu
from benchmarks.report import spread
from benchmarks.servers import ROOT, port_in, start

GEN = "/inference/v1/generate"
PATHS = ("direct", "sidecar", "completions", "direct-completions")
# The direct route each path's ratios are taken against, in the same round.
BASE_OF = {"direct": "direct", "sidecar": "direct", "completions": "direct-completions",
           "direct-completions": "direct-completions"}


async def drive(url: str, path: str, body: dict[str, Any], clients: int, requests: int,
                warmup: int) -> dict[str, Any]:
    lat: list[float] = []
    errors = 0

    async def client(c: httpx.AsyncClient, n: int) -> None:
        nonlocal errors
        for _ in range(n):
            t0 = time.perf_counter()
            r = await c.post(path, json=body)
            lat.append(time.perf_counter() - t0)
            errors += r.status_code != 200

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=clients)) as c:
        await asyncio.gather(*(client(c, warmup) for _ in range(clients)))
        lat.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, requests // clients) for _ in range(clients)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {"lat": lat, "wall": wall, "errors": errors}


class Profile:
    """py-spy (``--native``) on some processes while a ``with`` block runs, each into ``<prefix>-<name>.txt``
    (collapsed stacks), and ``<prefix>-threads.json``: each process's CPU seconds over the block by thread name. The
    engine's processes (names ``engine*``) are timed, not sampled: no pauses in its steps."""

    def __init__(self, out: Path | None, prefix: str, pids: dict[str, int]) -> None:
        self.out, self.prefix, self.pids = out, prefix, pids
        self.before: dict[str, dict[str, float]] = {}
        self.spies = contextlib.ExitStack()

    def __enter__(self) -> Profile:
        if self.out is not None:
            self.before = {k: thread_cpu(p) for k, p in self.pids.items()}
            for name, pid in self.pids.items():
                if not name.startswith("engine"):
                    self.spies.enter_context(Spy(pid, self.out / f"{self.prefix}-{name}.txt", rate=50, native=True))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.out is not None:
            after = {k: thread_cpu(p) for k, p in self.pids.items()}
            delta = {k: {t: round(v - self.before[k].get(t, 0.0), 2) for t, v in after[k].items()
                         if v - self.before[k].get(t, 0.0) > 0} for k in after}
            (self.out / f"{self.prefix}-threads.json").write_text(json.dumps(delta, indent=1))
        self.spies.close()


def measure(url: str, path: str, body: dict[str, Any], clients: int, requests: int, warmup: int,
            pids: dict[str, list[int]], profile: Profile | None = None) -> dict[str, Any]:
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    with profile or Profile(None, "", {}):
        out = asyncio.run(drive(url, path, body, clients, requests, warmup))
    n = len(out["lat"]) + warmup * clients  # the warm-up requests count for CPU too
    out["cpu_ms"] = {k: 1000 * (cpu_seconds(p) - before[k]) / n for k, p in pids.items()}
    return out


def summary(runs: list[dict[str, Any]], base: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """``runs`` of one path and ``base``, its direct route's runs of the same rounds: the ratios are per round."""
    lat = sorted(x for r in runs for x in r["lat"])
    keys = runs[0]["cpu_ms"].keys()
    return {"p50_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))],
            "tok_s": tokens * len(lat) / sum(r["wall"] for r in runs), "errors": sum(r["errors"] for r in runs),
            "cpu_ms": {k: statistics.median(r["cpu_ms"][k] for r in runs) for k in keys},
            "tok_ratio": spread([len(r["lat"]) * b["wall"] / (len(b["lat"]) * r["wall"])
                                 for r, b in zip(runs, base, strict=True)]),
            "cpu_ratio": spread([r["cpu_ms"]["tito"] / b["cpu_ms"]["tito"] for r, b in zip(runs, base, strict=True)])}


def vllm_bench(url: str, model: str, clients: int, requests: int, max_tokens: int, pids: dict[str, list[int]],
               env: dict[str, str]) -> dict[str, Any]:
    """vLLM's own benchmark client (random 32-token text prompts, streamed ``/v1/completions``) on ``url``, with each
    process's CPU per request (the warm-up requests count too)."""
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    res = vllm_client(url, model, "tiny", clients, requests, 32, max_tokens, env)
    n = requests + clients
    res["cpu_ms"] = {k: 1000 * (cpu_seconds(p) - before[k]) / n for k, p in pids.items()}
    return res


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks dynamo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-qwen3"))
    ap.add_argument("--requests", type=int, default=200, help="requests per path, client count and round")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of every path")
    ap.add_argument("--vllm-bench", action="store_true", help="also vLLM's own client (vllm bench serve)")
    ap.add_argument("--tito-args", default="", help="extra flags for tito, e.g. --tito-args='--stream-interval 4'")
    ap.add_argument("--dtype", default="float32", help="tito's --dtype (the tiny model's float32 by default)")
    ap.add_argument("--max-model-len", type=int, default=None, help="tito's --max-model-len (4096 at Qwen3's shapes: "
                    "its own 40,960 needs more KV cache than the 1 GiB tito gets on CPU)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"a subset of {','.join(PATHS)}; each brings its "
                    "direct route; empty: none (vLLM's client only, with --vllm-bench)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up requests per client before each measured run")
    ap.add_argument("--profile", type=Path, default=None, help="py-spy the frontend, sidecar and tito through each "
                    "path of the first round into this folder (py-spy from $PY_SPY or PATH)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    ns = ap.parse_args(argv)
    wanted = [x for x in ns.paths.split(",") if x]
    if set(wanted) - set(PATHS):
        ap.error(f"unknown path(s): {', '.join(sorted(set(wanted) - set(PATHS)))}")
    if not wanted and not ns.vllm_bench:
        ap.error("no paths and no --vllm-bench: nothing to measure")
    chosen = [x for x in PATHS if x in wanted or any(BASE_OF[w] == x for w in wanted)]
    if not (Path(ns.model) / "tokenizer.json").is_file():
        print(f"{ns.model} has no tokenizer: run tito make-tiny-model {ns.model}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="bench-dynamo-"))
    if ns.profile:
        ns.profile.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp / "kv"), "DYN_NAMESPACE": "bench",
           "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq", "DYN_TCP_RPC_HOST": "127.0.0.1",
           "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1",
           "DYN_SYSTEM_HOST": "127.0.0.1", "DYN_LOG": "warn", "VLLM_HOST_IP": "127.0.0.1", "PYTHONUNBUFFERED": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    procs: list[Any] = []  # ServerProcess, each in this session and a process group of its own
    try:
        port, grpc_port, fport = port_in(), port_in(), port_in()
        tito = start([sys.executable, "-m", "tito", "serve", "--model", ns.model, "--served-model-name", "tiny",
                      "--port", str(port), "--grpc-port", str(grpc_port), "--dtype", ns.dtype,
                      *(["--max-model-len", str(ns.max_model_len)] if ns.max_model_len else []),
                      *shlex.split(ns.tito_args)], port, tmp / "tito.log", env, 900, "/ready")
        procs.append(tito)
        sport = free_system_port()
        side = start([sys.executable, "-m", "dynamo.vllm.sidecar", "--grpc-endpoint", f"127.0.0.1:{grpc_port}",
                      "--enable-rl", "--vllm-http-endpoint", tito.url], sport, tmp / "sidecar.log",
                     {**env, "DYN_SYSTEM_PORT": str(sport)}, 300)
        procs.append(side)
        fe = start([sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(fport),
                    "--router-mode", "round-robin"], fport, tmp / "frontend.log",
                   {**env, "DYN_VLLM_ENABLE_INFERENCE_V1_GENERATE": "true"}, 300, "/live")
        procs.append(fe)
        deadline = time.monotonic() + 120
        while "tiny" not in {m["id"] for m in httpx.get(fe.url + "/v1/models").json().get("data", [])}:
            if time.monotonic() > deadline:
                raise RuntimeError("the model never showed up at the frontend")
            time.sleep(0.5)
        pids = {"frontend": [fe.proc.pid], "sidecar": [side.proc.pid], "tito": [tito.proc.pid],
                "engine": descendants(tito.proc.pid)}
        ids = list(range(5, 5 + 32))
        sp = {"max_tokens": ns.max_tokens, "temperature": 0.0, "ignore_eos": True}
        every = {"direct": (tito.url, GEN, {"token_ids": ids, "sampling_params": sp}),
                 "sidecar": (fe.url, GEN, {"model": "tiny", "token_ids": ids, "sampling_params": sp}),
                 "completions": (fe.url, "/v1/completions", {"model": "tiny", "prompt": ids, **sp}),
                 "direct-completions": (tito.url, "/v1/completions", {"model": "tiny", "prompt": ids, **sp})}
        paths = {k: every[k] for k in chosen}
        rows, vrows = [], []
        for clients in (int(c) for c in ns.clients.split(",")):
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in paths}
            for rnd in range(ns.rounds):
                for name, (url, path, body) in paths.items():
                    prof = Profile(ns.profile if rnd == 0 else None, f"c{clients}-{name}",
                                   {k: pids[k][0] for k in ("frontend", "sidecar", "tito")}
                                   | {f"engine-{p}": p for p in pids["engine"]})
                    runs[name].append(measure(url, path, body, clients, ns.requests, ns.warmup, pids, prof))
                    print(f"{clients} clients, {name}: {len(runs[name][-1]['lat'])} requests in "
                          f"{runs[name][-1]['wall']:.1f} s, CPU ms/req {runs[name][-1]['cpu_ms']}",
                          file=sys.stderr, flush=True)
            if paths:
                rows.append((clients, {k: summary(v, runs[BASE_OF[k]], ns.max_tokens) for k, v in runs.items()}))
            if ns.vllm_bench:
                vruns: dict[str, list[dict[str, Any]]] = {"direct-completions": [], "completions": []}
                for _ in range(ns.rounds):
                    for name, url in (("direct-completions", tito.url), ("completions", fe.url)):
                        vruns[name].append(vllm_bench(url, ns.model, clients, ns.requests, ns.max_tokens, pids, env))
                        print(f"{clients} clients, vllm bench {name}: {vruns[name][-1]}", file=sys.stderr, flush=True)
                vrows.append((clients, vruns))
    finally:
        for p in reversed(procs):
            p.stop(40)
    print(f"\n{ns.model}, {ns.max_tokens} new tokens per request, 32-token prompt, {ns.requests} requests per path "
          f"and round (+ {ns.warmup} warm-up per client), {ns.rounds} alternating rounds, {os.cpu_count()} cores, "
          f"tito's flags: --dtype {ns.dtype} --max-model-len {ns.max_model_len or 'default'} {ns.tito_args}")
    print("| clients | path | p50 ms | p99 ms | added p50 ms | tokens/s | tokens/s vs direct (min / median / max) "
          "| frontend CPU ms/req | sidecar CPU ms/req | tito CPU ms/req | tito CPU vs direct (min / median / max) "
          "| engine CPU ms/req | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for clients, s in rows:
        for name, r in s.items():
            c = r["cpu_ms"]
            base = s[BASE_OF[name]]
            added = "" if base is r else f"{r['p50_ms'] - base['p50_ms']:+.2f}"
            ratios = ("", "") if base is r else (r["tok_ratio"], r["cpu_ratio"])
            print(f"| {clients} | {name} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {added} | {r['tok_s']:.0f} | "
                  f"{ratios[0]} | {c['frontend']:.2f} | {c['sidecar']:.2f} | {c['tito']:.2f} | {ratios[1]} | "
                  f"{c['engine']:.1f} | {r['errors']} |")
    if vrows:
        print(f"\nvLLM's own client (vllm bench serve, random 32-token text prompts, streamed /v1/completions, "
              f"{ns.max_tokens} tokens out, {ns.requests} prompts per path and round, {ns.rounds} alternating rounds)")
        print("| clients | path | output tokens/s (median) | vs tito's route (min / median / max) | median TTFT ms "
              "| median TPOT ms | frontend CPU ms/req | sidecar CPU ms/req | tito CPU ms/req "
              "| tito CPU vs tito's route (min / median / max) | engine CPU ms/req | completed |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for clients, vr in vrows:
            for name, vruns_ in vr.items():
                vbase = vr["direct-completions"]
                pairs = list(zip(vruns_, vbase, strict=True))
                ratio = ("", "") if vruns_ is vbase else (
                    spread([r["output_throughput"] / b["output_throughput"] for r, b in pairs]),
                    spread([r["cpu_ms"]["tito"] / b["cpu_ms"]["tito"] for r, b in pairs]))
                med = {k: statistics.median(r[k] for r in vruns_) for k in ("output_throughput", "median_ttft_ms",
                                                                          "median_tpot_ms")}
                c = {k: statistics.median(r["cpu_ms"][k] for r in vruns_) for k in pids}
                print(f"| {clients} | {name} | {med['output_throughput']:.0f} | {ratio[0]} | "
                      f"{med['median_ttft_ms']:.1f} | {med['median_tpot_ms']:.2f} | {c['frontend']:.2f} | "
                      f"{c['sidecar']:.2f} | {c['tito']:.2f} | {ratio[1]} | {c['engine']:.1f} | "
                      f"{sum(r['completed'] for r in vruns_)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
