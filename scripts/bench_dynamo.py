"""Side by side: the same workload sent to one tito replica directly vs through Dynamo's frontend to two replicas.

    python scripts/bench_dynamo.py --model models/tiny-qwen3 [--requests 200] [--clients 1,8] [--max-tokens 16]

Starts two tito replicas (registered with Dynamo, file discovery in a temporary directory) and Dynamo's frontend
(``--router-mode round-robin``), then drives closed-loop clients: ``direct`` posts token ids to replica A's
``/inference/v1/generate``; ``frontend`` posts the same ids as a token prompt to the frontend's ``/v1/completions``
(same tokens in, same number out: ``ignore_eos``). Reports p50/p99 latency, req/s, the added p50, and the frontend
process's CPU per request (from /proc). On a 2-core machine the two replicas share the same two cores as one would:
this measures the frontend's overhead, not scaling. Needs the ``dynamo`` extra and ``ai-dynamo`` (see README).
"""

from __future__ import annotations

import argparse
import asyncio
import os
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

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Proc:
    def __init__(self, cmd: list[str], url: str, health: str, env: dict[str, str], log: Path) -> None:
        self.url, self.health = url, health
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        # Same session as this script (a new one is a new CFS autogroup: see README "Benchmark").
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


async def drive(url: str, path: str, body: dict[str, Any], clients: int, requests: int) -> dict[str, Any]:
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
        await asyncio.gather(*(client(c, 3) for _ in range(clients)))  # warm-up
        lat.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, requests // clients) for _ in range(clients)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {"p50_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))],
            "rps": len(lat) / wall, "errors": errors, "n": len(lat)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-qwen3"))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=16)
    ns = ap.parse_args()
    if not (Path(ns.model) / "tokenizer.json").is_file():
        print(f"{ns.model} has no tokenizer: run tito make-tiny-model {ns.model}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="bench-dynamo-"))
    env = {**os.environ, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp / "kv"), "DYN_NAMESPACE": "bench",
           "DYN_LOG": "warn", "VLLM_HOST_IP": "127.0.0.1", "PYTHONUNBUFFERED": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    procs: list[Proc] = []
    try:
        replicas = []
        for i in range(2):
            port = free_port()
            cmd = [sys.executable, "-m", "app", "serve", "--model", ns.model, "--served-model-name", "tiny",
                   "--port", str(port), "--dtype", "float32", "--dynamo-namespace", "bench"]
            replicas.append(Proc(cmd, f"http://127.0.0.1:{port}", "/health", env, tmp / f"replica{i}.log"))
        fport = free_port()
        fe = Proc([sys.executable, "-m", "dynamo.frontend", "--http-port", str(fport), "--discovery-backend", "file",
                   "--router-mode", "round-robin"], f"http://127.0.0.1:{fport}", "/live", env, tmp / "frontend.log")
        procs = [*replicas, fe]
        for p in procs:
            p.wait(600)
        deadline = time.monotonic() + 120
        while len(list((tmp / "kv" / "v1" / "instances").glob("*generate*"))) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("replicas not in discovery")
            time.sleep(0.5)
        ids = list(range(5, 5 + 32))
        direct_body = {"token_ids": ids, "sampling_params": {"max_tokens": ns.max_tokens, "temperature": 0.0,
                                                             "ignore_eos": True}}
        fe_body = {"model": "tiny", "prompt": ids, "max_tokens": ns.max_tokens, "temperature": 0.0,
                   "ignore_eos": True}
        rows = []
        for clients in (int(c) for c in ns.clients.split(",")):
            d = asyncio.run(drive(replicas[0].url, "/inference/v1/generate", direct_body, clients, ns.requests))
            c0 = cpu_seconds(fe.p.pid)
            f = asyncio.run(drive(fe.url, "/v1/completions", fe_body, clients, ns.requests))
            f["frontend_cpu_ms_per_req"] = 1000 * (cpu_seconds(fe.p.pid) - c0) / (f["n"] + 3 * clients)
            rows.append((clients, d, f))
    finally:
        for p in procs:
            p.stop()
    print(f"\n{ns.max_tokens} new tokens per request, 32-token prompt, {ns.requests} requests per cell, "
          f"{os.cpu_count()} cores")
    print("| clients | direct p50 ms | frontend→2 replicas p50 ms | added p50 ms | direct req/s | frontend req/s "
          "| frontend CPU ms/req | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for clients, d, f in rows:
        print(f"| {clients} | {d['p50_ms']:.2f} | {f['p50_ms']:.2f} | {f['p50_ms'] - d['p50_ms']:+.2f} | "
              f"{d['rps']:.0f} | {f['rps']:.0f} | {f['frontend_cpu_ms_per_req']:.2f} | {d['errors']}/{f['errors']} |")
    if (os.cpu_count() or 1) <= 4:
        print("\nOn this machine the two replicas share the same few cores: the difference is the frontend's "
              "overhead (an extra HTTP hop, tokenization, routing, detokenization), not scaling.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
