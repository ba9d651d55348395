"""``python -m benchmarks serving --vllm-bench``: tito against vLLM's own server under vLLM's own benchmark client
(``vllm.benchmarks.serve``: random text prompts, streamed ``/v1/completions``, or ``/v1/chat/completions`` for the
``-chat`` case, ``--ignore-eos``), plus, with ``--update``, a full weight update from disk on tito at the same model.

The token route (``/inference/v1/generate``, cases ``t16`` and ``t16-stream``): vLLM 0.32's benchmark client has no
backend for it (its request functions are the OpenAI, embedding, pooling and rerank ones), so those cases are driven
by tito's own load generator (``benchmarks/clients.py``, the lean keep-alive client, in a process of its own) with the
same shape: random token prompts of the case's length, ``ignore_eos``, temperature 1 (the load generator's), as
many warm-up requests as the concurrency. vLLM's server then runs ``--tokens-only`` (its dedicated token server,
which never detokenizes, as tito's token route never does); token and ``/v1/completions`` cases go in separate runs.

Each round starts tito and vLLM's server (``python -m vllm.entrypoints.openai.api_server``) fresh, one after the
other (the order alternates round by round), and drives each through the same cases. Per case and system: output
tokens/s, median TTFT and TPOT, and the CPU milliseconds per request of the serving (API) process; the ratios tito /
vLLM are taken round by round and printed as min / median / max.

``--defaults``: each server as a user starts it (model, port and ``--max-model-len 4096``: at Qwen3's own 40,960 the
KV cache needs more than the 1 GiB both get on CPU; vLLM's server also gets ``--gpu-memory-utilization 0.3``, without
which it refuses to start on a 24 GiB machine with other work running);
else both at tito's test settings (fp32, ``--max-model-len 512``, eager), equal settings.

    python -m benchmarks serving --vllm-bench --rounds 3                     # the tiny model, equal settings
    python -m benchmarks serving --vllm-bench --base main --cases c16-chat   # streamed chat, tito vs main vs vLLM
    python -m benchmarks serving --vllm-bench --defaults --update --model models/qwen3-0.6b --cases c16   # SHAPE=
    python -m benchmarks serving --vllm-bench --defaults --model models/qwen3-0.6b --cases t16,t16-stream \
        --tito-args=--enforce-eager --vllm-args=--enforce-eager      # the token route, both eager
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.clients import Streams, Workload, run_load, vllm_bench
from benchmarks.probes import Sampler, proc_mem, process_cpu_s
from benchmarks.report import spread
from benchmarks.servers import NAME, base_tree, from_checkout, port_in, reverse_odd, server_cmd, start


@dataclass(frozen=True)
class Case:
    name: str
    concurrency: int
    input_len: int
    output_len: int
    prompts: int
    route: str = "completions"  # or "tokens": /inference/v1/generate under tito's load generator
    stream: bool = True
    chat: bool = False  # streamed /v1/chat/completions (vLLM's openai-chat backend: include_usage on)


CASES = {c.name: c for c in (
    Case("c16", 16, 32, 64, 96),
    Case("c16-many", 16, 32, 64, 400),  # the tiny model: enough requests for the CPU per request
    Case("c64", 64, 32, 64, 256),
    Case("c16-long", 16, 1024, 256, 32),
    Case("t16", 16, 32, 64, 96, "tokens", stream=False),
    Case("t16-stream", 16, 32, 64, 96, "tokens"),
    Case("c16-chat", 16, 32, 64, 400, chat=True),  # c16-many's load as chat (the tiny model's chat template)
)}
# base: tito from --base (scripts/bench_base.py); eager: tito with --enforce-eager (tito and vLLM compile by default)
SYSTEMS = ("tito", "eager", "base", "vllm")
def drive_tokens(url: str, case: Case, pid: int, logs: Path) -> dict[str, Any]:
    """A token-route case: a warm-up of ``concurrency`` requests, then the case, each from tito's load generator in a
    process of its own; the API process's CPU over both, per request."""
    c0 = process_cpu_s(pid)
    res: dict[str, Any] = {}
    for name, n in ((f"{case.name}-warmup", case.concurrency), (case.name, case.prompts)):
        wl = Workload(name, case.concurrency, case.output_len, case.stream, n, "tok/s", case.input_len)
        res = run_load(url, wl, logs / "load.log", timeout=1800)
    cpu = process_cpu_s(pid) - c0
    # The names vLLM's client reports, so one table holds both kinds of case; no TTFT or TPOT: a JSON answer has no
    # first token, and the load generator reads a stream whole.
    return {"completed": res["ok"], "failed": res["errors"], "output_throughput": res["tok_s"],
            "median_ttft_ms": None, "median_tpot_ms": None, "p50_ms": res["p50_ms"],
            "error_samples": res["error_samples"], "cpu_ms_per_req": 1000.0 * cpu / (case.prompts + case.concurrency)}


def drive(url: str, model: str, case: Case, pid: int, env: dict[str, str], logs: Path) -> dict[str, Any]:
    if case.route == "tokens":
        return drive_tokens(url, case, pid, logs)
    c0 = process_cpu_s(pid)
    res = vllm_bench(url, model, NAME, case.concurrency, case.prompts, case.input_len, case.output_len, env,
                     chat=case.chat)
    # The warm-up requests are served too: they count for the CPU.
    res["cpu_ms_per_req"] = 1000.0 * (process_cpu_s(pid) - c0) / (case.prompts + case.concurrency)
    return res


def update(url: str, pid: int, model: str, max_tokens: int) -> dict[str, Any]:
    """pause(keep) -> POST /update_weights (the served checkpoint itself, from disk) -> resume, with one streamed
    request in flight: seconds, the longest gap between its events, the server's processes' peak memory above
    before."""
    mem = Sampler(pid)
    try:
        with Streams(url, 1, max_tokens) as streams, httpx.Client(base_url=url, timeout=900) as c:
            t0 = time.monotonic()
            base = mem.steady(t0)[0]
            c.post("/pause", params={"mode": "keep"}).raise_for_status()
            t1 = time.monotonic()
            r = c.post("/update_weights", json={"weight_dir": str(Path(model).resolve()), "weight_version": "bench"})
            t2 = time.monotonic()
            c.post("/resume").raise_for_status()
            t3 = time.monotonic()
            r.raise_for_status()
            streams.after(t3)
            peak = mem.peak(t0, time.monotonic())[0]
            gap = streams.gap(t0, t3)
    finally:
        mem.close()
    return {"update_s": t2 - t1, "pause_to_resume_s": t3 - t0, "longest_gap_s": gap,
            "peak_above_gb": (peak - base) / 1e9, "after_above_gb": (proc_mem(pid)[0] - base) / 1e9}


def run_round(r: int, systems: list[str], ns: Any, model: str, cases: list[Case], logs: Path,
              base: str | None) -> dict[str, Any]:
    from tests.helpers import EAGER_ENV, engine_env

    out: dict[str, Any] = {}
    for system in reverse_odd(systems, r):
        port = port_in(ns.port_range)
        cmd = server_cmd(system, model, port, ns.defaults, ns.vllm_args if system == "vllm" else ns.tito_args,
                         tokens_only=all(c.route == "tokens" for c in cases))
        if system == "base":
            assert base is not None
            cmd = from_checkout(cmd, base)
        print(f"round {r + 1}: {system}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        # At its defaults tito compiles, as vLLM's server: the suite's eager default for tito is lifted.
        env = engine_env({EAGER_ENV: None} if ns.defaults and system != "eager" else None)
        t0 = time.monotonic()
        server = start(cmd, port, logs / f"{system}-{port}.log", env, ns.start_timeout)
        this: dict[str, Any] = {"start_s": time.monotonic() - t0}
        try:
            for case in cases:
                this[case.name] = drive(server.url, model, case, server.proc.pid, engine_env(), logs)
                print(f"round {r + 1}: {system} {case.name}: {this[case.name]}", file=sys.stderr, flush=True)
            if ns.update and system != "vllm":
                this["update"] = update(server.url, server.proc.pid, model, (4096 if ns.defaults else 512) - 32)
                print(f"round {r + 1}: {system} update: {this['update']}", file=sys.stderr, flush=True)
        finally:
            server.kill()
        out[system] = this
    return out


def report(rounds: list[dict[str, Any]], cases: list[Case]) -> str:
    lines = ["| case | system | output tok/s (min / median / max) | tok/s tito / vLLM | median TPOT ms | "
             "median TTFT ms | CPU ms/req, API process | CPU tito / vLLM | completed / failed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case in cases:
        for system in SYSTEMS:
            runs = [r[system][case.name] for r in rounds if system in r]
            if not runs:
                continue
            ratio = ("", "")
            both = [(r[system][case.name], r["vllm"][case.name]) for r in rounds if system in r and "vllm" in r]
            if system != "vllm" and both:
                ratio = (spread([a["output_throughput"] / b["output_throughput"] for a, b in both]),
                         spread([a["cpu_ms_per_req"] / b["cpu_ms_per_req"] for a, b in both]))
            med = {k: f"{statistics.median(x[k] for x in runs):.1f}" if runs[0][k] is not None else "-"
                   for k in ("median_tpot_ms", "median_ttft_ms")}
            what = ("/v1/completions, streamed" if case.route == "completions" else
                    f"/inference/v1/generate{', streamed' if case.stream else ''}, p50 "
                    f"{statistics.median(x['p50_ms'] for x in runs):.0f} ms")
            lines.append(
                f"| {case.name} ({what}, {case.concurrency} concurrent, {case.input_len} in / {case.output_len} out) | "
                f"{system} | {spread([x['output_throughput'] for x in runs])} | {ratio[0]} | "
                f"{med['median_tpot_ms']} | {med['median_ttft_ms']} | "
                f"{spread([x['cpu_ms_per_req'] for x in runs])} | {ratio[1]} | "
                f"{sum(x['completed'] for x in runs)} / {sum(x.get('failed', 0) for x in runs)} |")
    ab = [(r["tito"][c.name]["cpu_ms_per_req"] / r["base"][c.name]["cpu_ms_per_req"], c.name)
          for r in rounds if "base" in r and "tito" in r for c in cases]
    for name in dict.fromkeys(n for _, n in ab):
        lines.append(f"\n{name}: tito's CPU per request / base's, round by round: "
                     f"{spread([x for x, n in ab if n == name])}")
    starts = {s: [r[s]["start_s"] for r in rounds if s in r] for s in SYSTEMS}
    lines.append("")
    lines.append("Seconds to healthy: " + "; ".join(f"{s} {spread(v)}" for s, v in starts.items() if v))
    for system in SYSTEMS:
        ups = [r[system]["update"] for r in rounds if "update" in r.get(system, {})]
        if not ups:
            continue
        lines += ["", f"| {system}: full update from disk | min / median / max |", "|---|---|"]
        for k, label in (("update_s", "`/update_weights` seconds"), ("pause_to_resume_s", "pause to resume, seconds"),
                         ("longest_gap_s", "longest gap a streaming client saw, seconds"),
                         ("peak_above_gb", "peak memory above before, GB (server and engine processes)"),
                         ("after_above_gb", "memory after, above before, GB")):
            lines.append(f"| {label} | {spread([u[k] for u in ups])} |")
    return "\n".join(lines)


def main(ns: Any, model: str) -> int:
    cases = [CASES[c] for c in ns.cases.split(",")]
    if len({c.route for c in cases}) > 1:
        # vLLM's server answers the token route --tokens-only, which serves no /v1/completions.
        raise SystemExit("token-route cases (t16, t16-stream) and /v1/completions cases go in separate runs")
    systems = [s for s in (ns.systems or ",".join(x for x in SYSTEMS if x not in ("base", "eager") or ns.base and
                                                   x == "base")).split(",") if s]
    out = Path(ns.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, Any]] = []
    base, exported = base_tree(ns.base) if ns.base else (None, None)
    try:
        for r in range(ns.rounds):
            rounds.append(run_round(r, systems, ns, model, cases, logs, base))
            (out / "bench-openai-partial.json").write_text(json.dumps({"rounds": rounds}, indent=1))
    finally:
        if exported:
            import shutil

            shutil.rmtree(exported, ignore_errors=True)
    text = report(rounds, cases)
    print(f"\n{model}, {'each server at its defaults' if ns.defaults else 'equal settings (fp32, eager, 512)'}, "
          f"{ns.rounds} rounds, order alternating\n")
    print(text)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    doc = json.dumps({"model": model, "defaults": ns.defaults, "rounds": rounds, "table": text}, indent=1)
    (out / f"bench-openai-{stamp}.json").write_text(doc)
    (out / "bench-openai.json").write_text(doc)
    failed = sum(r[s][c.name].get("failed", 0) for r in rounds for s in r for c in cases)
    return 1 if failed else 0
