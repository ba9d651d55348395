"""Direct vs the Dynamo sidecar path: the same token requests sent to one tito replica's HTTP API, and through Dynamo's
frontend → Dynamo's vLLM sidecar → tito's ``vllm.Inference`` (gRPC) on the same replica.

    python scripts/bench_dynamo.py --model models/tiny-qwen3 [--requests 200] [--clients 1,8] [--max-tokens 16]
        [--rounds 2] [--vllm-bench] [--tito-args="--stream-interval 4"] [--paths direct,sidecar] [--warmup 3]
    python scripts/bench_dynamo.py --model models/qwen3-0.6b --dtype bfloat16 --max-model-len 4096 \
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
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from app.dynamo.sidecar import free_system_port

ROOT = Path(__file__).resolve().parent.parent
GEN = "/inference/v1/generate"
PATHS = ("direct", "sidecar", "completions", "direct-completions")
# The direct route each path's ratios are taken against, in the same round.
BASE_OF = {"direct": "direct", "sidecar": "direct", "completions": "direct-completions",
           "direct-completions": "direct-completions"}


def free_port() -> int:
    """A free loopback port (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of some processes (all their threads), from /proc; a process that is gone counts 0."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (tito's EngineCore and its helpers), from /proc."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


class Proc:
    def __init__(self, cmd: list[str], url: str, health: str, env: dict[str, str], log: Path) -> None:
        self.url, self.health = url, health
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        # Same session as this script (a new one is a new CFS autogroup: see docs/benchmarks/index.md).
        self.p = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                  process_group=0)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.p.args!r} exited with {self.p.returncode}")
            try:
                if httpx.get(self.url + self.health, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.url} not healthy after {timeout}s")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(40)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()


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


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads, summed by thread name (``tokio-runtime-w``, ``MainThread``...): py-spy
    samples only threads that run Python, and the frontend's and the sidecar's work is mostly on Rust threads."""
    out: dict[str, float] = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (t / "comm").read_text().strip()
            fields = (t / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


class Profile:
    """py-spy on some processes while a ``with`` block runs; each writes ``<prefix>-<name>.txt`` (collapsed stacks)
    when it is stopped (SIGINT) at the block's end, and ``<prefix>-threads.json``: each process's CPU seconds over
    the block by thread name."""

    def __init__(self, out: Path | None, prefix: str, pids: dict[str, int]) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.out, self.prefix, self.pids = out, prefix, pids
        self.before: dict[str, dict[str, float]] = {}
        if out is None:
            return
        self.before = {k: thread_cpu(p) for k, p in pids.items()}
        spy = os.environ.get("PY_SPY", "py-spy")
        for name, pid in pids.items():
            if name.startswith("engine"):  # the engine's threads are timed, not sampled: no pauses in its steps
                continue
            self.procs.append(subprocess.Popen(
                [spy, "record", "--native", "--rate", "50", "--format", "raw", "--pid", str(pid),
                 "--output",
                 str(out / f"{prefix}-{name}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def __enter__(self) -> Profile:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.out is not None:
            after = {k: thread_cpu(p) for k, p in self.pids.items()}
            delta = {k: {t: round(v - self.before[k].get(t, 0.0), 2) for t, v in after[k].items()
                         if v - self.before[k].get(t, 0.0) > 0} for k in after}
            (self.out / f"{self.prefix}-threads.json").write_text(json.dumps(delta, indent=1))
        for p in self.procs:
            p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


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


def spread(xs: list[float]) -> str:
    """min / median / max, as the tables print them."""
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


# vLLM's own benchmark client, in a child process (its results as one JSON line).
VLLM_BENCH = ("import json, sys\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "p = FlexibleArgumentParser()\nadd_cli_args(p)\nr = main(p.parse_args(sys.argv[1:]))\n"
              "print('RESULT ' + json.dumps({k: r[k] for k in ('completed', 'output_throughput', "
              "'median_ttft_ms', 'median_tpot_ms')}))\n")


def vllm_bench(url: str, model: str, clients: int, requests: int, max_tokens: int, pids: dict[str, list[int]],
               env: dict[str, str]) -> dict[str, Any]:
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    cmd = [sys.executable, "-c", VLLM_BENCH, "--backend", "openai", "--base-url", url, "--endpoint",
           "/v1/completions", "--model", "tiny", "--tokenizer", model, "--dataset-name", "random",
           "--random-input-len", "32", "--random-output-len", str(max_tokens), "--num-prompts", str(requests),
           "--max-concurrency", str(clients), "--ignore-eos", "--temperature", "0", "--disable-tqdm",
           "--num-warmups", str(clients)]
    out = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"vllm bench serve failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    res = json.loads(line[7:])
    n = requests + clients
    res["cpu_ms"] = {k: 1000 * (cpu_seconds(p) - before[k]) / n for k, p in pids.items()}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ns = ap.parse_args()
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
    procs: list[Proc] = []
    try:
        port, grpc_port, fport = free_port(), free_port(), free_port()
        tito = Proc([sys.executable, "-m", "tito", "serve", "--model", ns.model, "--served-model-name", "tiny",
                     "--port", str(port), "--grpc-port", str(grpc_port), "--dtype", ns.dtype,
                     *(["--max-model-len", str(ns.max_model_len)] if ns.max_model_len else []),
                     *shlex.split(ns.tito_args)],
                    f"http://127.0.0.1:{port}", "/ready", env, tmp / "tito.log")
        procs.append(tito)
        tito.wait(900)
        sport = free_system_port()
        side = Proc([sys.executable, "-m", "dynamo.vllm.sidecar", "--grpc-endpoint", f"127.0.0.1:{grpc_port}",
                     "--enable-rl", "--vllm-http-endpoint", tito.url], f"http://127.0.0.1:{sport}", "/health",
                    {**env, "DYN_SYSTEM_PORT": str(sport)}, tmp / "sidecar.log")
        fe = Proc([sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(fport),
                   "--router-mode", "round-robin"], f"http://127.0.0.1:{fport}", "/live",
                  {**env, "DYN_VLLM_ENABLE_INFERENCE_V1_GENERATE": "true"}, tmp / "frontend.log")
        procs += [side, fe]
        side.wait(300)
        fe.wait(300)
        deadline = time.monotonic() + 120
        while "tiny" not in {m["id"] for m in httpx.get(fe.url + "/v1/models").json().get("data", [])}:
            if time.monotonic() > deadline:
                raise RuntimeError("the model never showed up at the frontend")
            time.sleep(0.5)
        pids = {"frontend": [fe.p.pid], "sidecar": [side.p.pid], "tito": [tito.p.pid],
                "engine": descendants(tito.p.pid)}
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
            p.stop()
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
