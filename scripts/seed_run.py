#!/usr/bin/env python
"""The seed's run, as the seed ran it, on this machine (``make seed-run``): Prime-RL's orchestrator, unchanged, finding
tito through Dynamo, on a Qwen3-0.6B-shaped model, for 3 steps.

- Dynamo's frontend (KV routing, request migration, Dynamo's own ``/inference/v1/generate``, RL discovery) and tito,
  which starts and supervises Dynamo's vLLM sidecar (``tito serve --dynamo-namespace``), file discovery on loopback:
  what ``make dynamo`` starts.
- Prime-RL's ``rl`` launcher writes the configs from one ``rl.toml`` (``--dry-run``); Prime-RL's ``env-server`` and
  ``orchestrator`` run unchanged from ``../shared/thirdparty/prime-rl``; tito's stand-in trainer takes the trainer's
  place (scripts/prime_run/trainer.py: Prime-RL's batch receiver and checkpoint writer, a real AdamW step on CPU).
- The orchestrator's admin URLs are the ones Dynamo's RL discovery (``/v1/rl/workers``) lists, read here and given to
  Prime-RL as ``admin_base_url`` (this snapshot predates Prime-RL's own Dynamo discovery client); its rollouts (its
  renderer client posts token ids to ``/inference/v1/generate``) go to the tito that discovery lists.
  ``--data-plane frontend`` sends them through Dynamo's frontend instead, where Dynamo 1.6.1's vLLM sidecar refuses
  every request Prime-RL's orchestrator makes before tito sees it (its log: ``extra_args.vllm_tito.sampling_params.
  cache_salt is not supported by the sidecar``, ``top_k=-1 or top_k=0 cannot be represented by vllm-proto 0.3``,
  ``min_p=0 cannot be represented by vllm-proto 0.3``; Prime-RL sends all three on every rollout), and the frontend
  answers 400 "Invalid request".

Prints the seed's table and writes ``OUT/seed-run.json``. ``--route http`` runs the same straight at tito's HTTP (no
Dynamo), for the comparison. Every process runs in this process's session and is ended at exit.

    python scripts/seed_run.py --out /tmp/seed                       # Qwen3-0.6B's shape, through Dynamo
    python scripts/seed_run.py --route http --out /tmp/seed-http     # the same straight at tito
    python scripts/seed_run.py --model models/tiny-qwen3 --dtype float32 --served-name tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.dynamo.sidecar import free_system_port  # noqa: E402
from scripts.prime_run.run import PrimeRun, free_port, prime_rl_missing, stop_in_order  # noqa: E402

PY = sys.executable
NS = "seedrun"


def _dyn_env(kv: Path) -> dict[str, str]:
    """Dynamo on one machine, as scripts/dynamo_local.sh sets it: file discovery, TCP request plane, ZMQ events."""
    return {**os.environ, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(kv), "DYN_NAMESPACE": NS,
            "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq", "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1",
            "DYN_SYSTEM_HOST": "127.0.0.1", "VLLM_HOST_IP": "127.0.0.1", "DYN_LOG": "warn"}


class Stack:
    """tito (and, through Dynamo, its sidecar and the frontend), each in its own process group of this session."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.out, self.args = out, args
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tito: subprocess.Popen[bytes] | None = None
        self.tito_url = ""
        self.frontend_url = ""
        self.rl_url = ""

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(argv, env=env, stdout=(self.out / f"{name}.log").open("wb"), stderr=subprocess.STDOUT,
                             cwd=ROOT, process_group=0)
        self.procs.append(p)
        return p

    def start(self) -> None:
        a = self.args
        dynamo = a.route == "dynamo"
        env = _dyn_env(self.out / "dyn-kv") if dynamo else dict(os.environ)
        port = free_port()
        self.tito_url = f"http://127.0.0.1:{port}"
        cmd = [PY, "-m", "tito", "serve", "--model", str(a.model), "--served-model-name", a.served_name,
               "--port", str(port), "--dtype", a.dtype, "--max-model-len", str(a.max_model_len),
               "--allowed-weight-root", str(self.out), "--state-dir", str(self.out / "tito-state"),
               "--logprobs-mode", "processed_logprobs", *a.tito_arg]
        if dynamo:
            cmd += ["--grpc-port", str(free_port()), "--block-size", "32", "--kv-events-port", "0",
                    "--dynamo-namespace", NS, "--dynamo-system-port", str(free_system_port())]
        self.tito = self._start("tito", cmd, env)
        if dynamo:
            fe, rl = free_port(), free_port()
            self.frontend_url, self.rl_url = f"http://127.0.0.1:{fe}", f"http://127.0.0.1:{rl}"
            self._start("frontend", [PY, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(fe),
                                     "--router-mode", "kv", "--migration-limit", "3"],
                        {**env, "DYN_ENABLE_RL": "true", "DYN_RL_PORT": str(rl),
                         "DYN_VLLM_ENABLE_INFERENCE_V1_GENERATE": "true"})
        self._wait(lambda: _get(self.tito_url + "/ready") == 200, 900, "tito to be ready", self.tito)
        if dynamo:
            self._wait(lambda: a.served_name in _models(self.frontend_url), 300, "the model at Dynamo's frontend")
            self._wait(lambda: len(_workers(self.rl_url)) == 1, 300, "tito in Dynamo's /v1/rl/workers")

    def _wait(self, pred: Any, timeout: float, what: str, proc: subprocess.Popen[bytes] | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            for p in [proc] if proc else self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"exited ({p.returncode}) while waiting for {what}; logs in {self.out}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; logs in {self.out}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Each process as a supervisor stops it, the last started first (Dynamo's frontend, then tito, which drains,
        leaves discovery, stops its sidecar and then its engine), never a whole process group at once."""
        for p in reversed(self.procs):
            code = stop_in_order(p)
            if code not in (0, None) and p is self.tito:
                print(f"seed-run: tito exited with {code} on SIGTERM; see {self.out / 'tito.log'}", file=sys.stderr)


async def serving_rate(url: str, model: str, n: int, concurrency: int, prompt_len: int, max_tokens: int
                       ) -> dict[str, float]:
    """tito's own rate on ``n`` requests like the run's (``prompt_len`` token ids, ``max_tokens`` sampled at
    temperature 1 without stopping early), ``concurrency`` at a time, straight at its token route."""
    sem = asyncio.Semaphore(concurrency)

    async def one(c: httpx.AsyncClient, i: int) -> int:
        async with sem:
            r = await c.post(url + "/inference/v1/generate", json={
                "model": model, "token_ids": [(7 * i + j) % 1000 + 3 for j in range(prompt_len)],
                "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}})
            r.raise_for_status()
            return len(r.json()["choices"][0]["token_ids"])

    async with httpx.AsyncClient(timeout=600) as c:
        t = time.monotonic()
        made = sum(await asyncio.gather(*(one(c, i) for i in range(n))))
        took = time.monotonic() - t
    return {"tokens": made, "seconds": round(took, 1), "tokens_per_s": round(made / took, 2), "requests": n,
            "concurrency": concurrency, "prompt_tokens": prompt_len, "max_tokens": max_tokens}


def _get(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _models(url: str) -> list[str]:
    try:
        return [m["id"] for m in httpx.get(url + "/v1/models", timeout=5).json().get("data", [])]
    except (httpx.HTTPError, ValueError):
        return []


def _workers(rl_url: str) -> list[dict[str, Any]]:
    try:
        return [w for w in httpx.get(rl_url + "/v1/rl/workers", timeout=10).json().get("workers", [])
                if w.get("admin_base_url")]
    except (httpx.HTTPError, ValueError):
        return []


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith(name + "_created"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Memory:
    """The peak resident memory of tito's whole process tree (API server, engine core, workers, sidecar)."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.peak = 0

    def sample(self) -> int:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
            rss = sum(p.memory_info().rss for p in procs if p.is_running())
        except psutil.Error:
            return 0
        self.peak = max(self.peak, rss)
        return rss


def _updates(log: str) -> list[dict[str, Any]]:
    """Each weight update in tito's log: its version, seconds and bytes, and the pause around it (the time from
    "generation paused" to "generation resumed", what every request in flight waited)."""
    def ts(line: str) -> float:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()

    out: list[dict[str, Any]] = []
    paused_at = None
    for line in log.splitlines():
        if "tito.control: generation paused" in line:
            paused_at = ts(line)
        elif m := re.search(r"weights updated from disk: version=(\S+), (\d+) bytes in ([\d.]+)s", line):
            out.append({"version": m.group(1).rstrip(","), "bytes": int(m.group(2)), "update_s": float(m.group(3))})
        elif "tito.control: generation resumed" in line and paused_at is not None and out and "pause_s" not in out[-1]:
            out[-1]["pause_s"] = round(ts(line) - paused_at, 3)
            paused_at = None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="A model directory (default: models/qwen3-0.6b, written by tito make-tiny-model --shape "
                   "qwen3-0.6b if missing).")
    p.add_argument("--served-name", default="Qwen3-0.6B", help="The name the model is served under.")
    p.add_argument("--dtype", default="auto", help="tito's --dtype (auto: the checkpoint's, bf16 for the shape).")
    p.add_argument("--max-model-len", type=int, default=2048, help="Context (also Prime-RL's seq_len).")
    p.add_argument("--route", choices=["dynamo", "http"], default="dynamo",
                   help="dynamo: tito under Dynamo, Prime-RL's admin URLs from Dynamo's RL discovery; http: "
                   "tito alone, straight at its HTTP.")
    p.add_argument("--data-plane", choices=["tito", "frontend"], default="tito",
                   help="With --route dynamo, where the rollouts go: tito (the origin Dynamo's discovery lists; "
                   "default) or Dynamo's frontend, where Dynamo 1.6.1's vLLM sidecar refuses Prime-RL's requests "
                   "(cache_salt in sampling_params, top_k=-1, min_p=0; the frontend answers 400; see "
                   "docs/guides/prime-rl-orchestrator.md).")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-inflight", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256, help="Completion tokens per rollout.")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--trainer-threads", type=int, default=1,
                   help="The stand-in trainer's torch threads (0: torch's default, one per core; 1 leaves tito's "
                   "engine its core on a 2-core machine, where two threads made both slower).")
    p.add_argument("--train-layers", type=int, default=2,
                   help="The stand-in trainer trains the last N transformer blocks and the final norm (0: the whole "
                   "model; on 2 CPU cores shared with tito a whole-model step at 0.6B is slower than the "
                   "orchestrator's next batch, so the last version would not be applied).")
    p.add_argument("--out", type=Path, default=None, help="Output directory (default: a new temporary one).")
    p.add_argument("--tito-arg", action="append", default=[], help="One more argument for tito serve (repeatable).")
    a = p.parse_args()

    if (why := prime_rl_missing()) is not None:
        print(f"seed-run: {why}", file=sys.stderr)
        return 2
    if a.model is None:
        a.model = ROOT / "models" / "qwen3-0.6b"
        if not (a.model / "config.json").is_file():
            print(f"seed-run: writing the Qwen3-0.6B-shaped model at {a.model}", file=sys.stderr)
            subprocess.run([PY, "-m", "tito", "make-tiny-model", str(a.model), "--shape", "qwen3-0.6b"], check=True)
    a.model = a.model.resolve()
    out = (a.out or Path(tempfile.mkdtemp(prefix="seed-run-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"seed-run: output in {out}", file=sys.stderr)

    stack = Stack(out, a)
    run: PrimeRun | None = None
    try:
        t = time.monotonic()
        stack.start()
        start_s = time.monotonic() - t
        assert stack.tito is not None
        if a.route == "dynamo":
            workers = _workers(stack.rl_url)
            admin = [w["admin_base_url"].rstrip("/") for w in workers]
            base_url = (stack.frontend_url if a.data_plane == "frontend" else admin[0]) + "/v1"
            discovery: dict[str, Any] = {"via": "dynamo", "data_plane": a.data_plane,
                                         "rl_workers_url": stack.rl_url + "/v1/rl/workers",
                                         "admin_base_url": admin, "base_url": base_url,
                                         "workers": [{k: w.get(k) for k in ("component", "instance_id", "model",
                                                                            "world_size")} for w in workers]}
        else:
            admin, base_url = [stack.tito_url], stack.tito_url + "/v1"
            discovery = {"via": "direct", "data_plane": "tito", "admin_base_url": admin, "base_url": base_url}
        mem = Memory(stack.tito.pid)
        steady = mem.sample()
        tokens0 = _metric(stack.tito_url, "vllm:generation_tokens_total")
        prompts0 = _metric(stack.tito_url, "vllm:prompt_tokens_total")
        requests0 = _metric(stack.tito_url, "vllm:request_success_total")
        run = PrimeRun(out, a.model, a.served_name, base_url, admin, steps=a.steps, seq_len=a.max_model_len,
                       batch_size=a.batch_size, group_size=a.group_size, max_inflight=a.max_inflight,
                       max_tokens=a.max_tokens, lr=a.lr, train_layers=a.train_layers,
                       trainer_threads=a.trainer_threads, timeout=3600)
        probes: dict[int, bool] = {}

        def on_version(k: int) -> None:
            rec = run.trainer_record(k) if run is not None else {}
            r = httpx.post(stack.tito_url + "/inference/v1/generate", timeout=300, json={
                "model": a.served_name, "token_ids": rec["probe"],
                "sampling_params": {"max_tokens": len(rec["probe_greedy"]), "temperature": 0, "ignore_eos": True}})
            probes[k] = r.status_code == 200 and r.json()["choices"][0]["token_ids"] == rec["probe_greedy"]

        res = run.run(on_version=on_version, sample=mem.sample)
        tokens = _metric(stack.tito_url, "vllm:generation_tokens_total") - tokens0
        restarts = 0 if stack.tito.poll() is None and _get(stack.tito_url + "/ready") == 200 else 1
        updates = _updates((out / "tito.log").read_text(errors="replace"))
        failed_http = _metric(stack.tito_url, 'tito_requests_total{route="/inference/v1/generate",status="5')
        # tito alone on the run's requests (as many as its rollouts, as long, as many at once): the rate the run would
        # have if only serving bound it.
        requests = _metric(stack.tito_url, "vllm:request_success_total") - requests0
        prompt_len = round((_metric(stack.tito_url, "vllm:prompt_tokens_total") - prompts0) / max(requests, 1))
        serving = (asyncio.run(serving_rate(stack.tito_url, a.served_name, res["rollouts"], a.max_inflight,
                                            max(prompt_len, 1), a.max_tokens))
                   if restarts == 0 and res["rollouts"] else None)
    finally:
        if run is not None:
            run.stop()
        stack.stop()

    seconds = res["orchestrator_loop_s"] or res["wall_s"]
    summary = {
        "model": {"dir": str(a.model), "served_name": a.served_name, "dtype": a.dtype,
                  "architecture": json.loads((a.model / "config.json").read_text()).get("architectures")},
        "route": a.route, "steps": len(res["steps_logged"]), "reloads": len(updates), "tokens": int(tokens),
        "tokens_per_s": round(tokens / seconds, 2) if seconds else None, "seconds": round(seconds, 1),
        "restarts": restarts, "failed_requests": res["failed_rollouts"] + int(failed_http),
        "update_s": [u["update_s"] for u in updates], "pause_s": [u.get("pause_s") for u in updates],
        "update_versions": [u["version"] for u in updates], "update_bytes": [u["bytes"] for u in updates],
        "peak_memory_gb": round(mem.peak / 2**30, 2), "steady_memory_gb": round(steady / 2**30, 2),
        "orchestrator_exit": res["orchestrator_exit"], "discovery": discovery, "rollouts": res["rollouts"],
        "rewards": [s["reward"] for s in res["steps_logged"]],
        "probe_matches_trainer": [probes.get(k) for k in sorted(probes)],
        "trainer_logprob_gap": [r.get("max_logprob_gap") for r in res["trainer"] if "max_logprob_gap" in r],
        "trainer_step_s": [round(r["train_s"] + r["write_s"], 1) for r in res["trainer"] if "train_s" in r],
        "serving": serving,
        "tito_start_s": round(start_s, 1), "out": str(out), "run_dir": res["run_dir"],
        "date": datetime.now().strftime("%Y-%m-%d %H:%M"),
    }
    (out / "seed-run.json").write_text(json.dumps(summary, indent=2) + "\n")
    rows = [("model", f"{a.model.name} ({a.dtype}), served as {a.served_name}"), ("route", discovery["via"]),
            ("steps", summary["steps"]), ("weight reloads", summary["reloads"]),
            ("tokens generated", summary["tokens"]),
            ("tokens/s over the step loop", summary["tokens_per_s"]),
            ("tokens/s, tito alone", "-" if serving is None else
             f"{serving['tokens_per_s']} (the run's {serving['requests']} requests, {serving['concurrency']} at a "
             f"time, {serving['prompt_tokens']} + {serving['max_tokens']} tokens each)"),
            ("trainer step s (each)", ", ".join(f"{x:.1f}" for x in summary["trainer_step_s"])),
            ("server restarts", summary["restarts"]),
            ("failed requests", summary["failed_requests"]),
            ("update s (each)", ", ".join(f"{x:.2f}" for x in summary["update_s"])),
            ("pause s (each)", ", ".join(f"{x:.2f}" for x in summary["pause_s"] if x is not None)),
            ("peak memory GB", f"{summary['peak_memory_gb']} (steady {summary['steady_memory_gb']})"),
            ("rewards by step", ", ".join(f"{x:.3f}" for x in summary["rewards"])),
            ("orchestrator exit", summary["orchestrator_exit"]),
            ("admin URLs", ", ".join(discovery["admin_base_url"]) + f" ({discovery['via']})")]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    print(f"seed-run: {out / 'seed-run.json'}", file=sys.stderr)
    ok = (summary["orchestrator_exit"] == 0 and summary["steps"] == a.steps and summary["restarts"] == 0
          and summary["failed_requests"] == 0)
    if ok and summary["reloads"] < a.steps:
        # Prime-RL's orchestrator ships its last batch once v{steps-2} is in and stops: the last version reaches tito
        # only if the trainer's step beats the collection of that batch.
        print(f"seed-run: {summary['reloads']} weight reloads, not {a.steps}: the trainer's steps "
              f"({summary['trainer_step_s']} s) were slower than the orchestrator's last batch", file=sys.stderr)
    return 0 if ok and summary["reloads"] == a.steps else 1


if __name__ == "__main__":
    sys.exit(main())
