"""Seconds to healthy, with and without vLLM's compile cache: tito and vLLM's server at their defaults (both compile
on CPU), and tito with ``--enforce-eager``.

Each round gives each system a fresh, empty ``VLLM_CACHE_ROOT`` (cold: torch.compile compiles the model) and then
starts it once more on that same root (warm: vLLM reads the compiled graphs back). Systems alternate order round by
round. ``/health`` answering 200 is "healthy" for both servers (tito's /health answers once the engine is up).

    python scripts/bench_start.py --model models/qwen3-0.6b --rounds 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SYSTEMS = ("tito", "eager", "vllm")


def command(system: str, model: str, port: int, max_model_len: int) -> list[str]:
    if system == "vllm":
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
                "--max-model-len", str(max_model_len), "--gpu-memory-utilization", "0.3"]
    cmd = [sys.executable, "-m", "tito", "serve", "--model", model, "--port", str(port), "--max-model-len",
           str(max_model_len)]
    return cmd + (["--enforce-eager"] if system == "eager" else [])


def start_seconds(system: str, model: str, max_model_len: int, cache: Path, log: Path, timeout: float) -> float:
    from tests.helpers import EAGER_ENV, ServerProcess, engine_env, free_port

    port = free_port()
    env = engine_env({"VLLM_CACHE_ROOT": str(cache), EAGER_ENV: None})
    server = ServerProcess(command(system, model, port, max_model_len), port, log, env=env)
    server.start(timeout=timeout)
    try:
        return ServerProcess.starts[-1].seconds
    finally:
        server.stop()


def spread(xs: list[float]) -> str:
    return f"{min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f}" if xs else "–"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"Comma-separated subset of {','.join(SYSTEMS)}.")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--timeout", type=float, default=1200.0, help="Seconds one start may take.")
    p.add_argument("--out", type=Path, default=Path("results/bench_start"))
    ns = p.parse_args()
    systems = [s for s in ns.systems.split(",") if s]
    ns.out.mkdir(parents=True, exist_ok=True)
    got: dict[str, dict[str, list[float]]] = {s: {"cold": [], "warm": []} for s in systems}
    for r in range(ns.rounds):
        for system in systems if r % 2 == 0 else systems[::-1]:
            cache = Path(tempfile.mkdtemp(prefix=f"vllm-cache-{system}-"))
            try:
                for kind in ("cold", "warm"):
                    s = start_seconds(system, ns.model, ns.max_model_len, cache,
                                      ns.out / f"{system}-{kind}-{r}.log", ns.timeout)
                    got[system][kind].append(s)
                    print(f"round {r + 1}: {system} {kind}: {s:.1f}s", file=sys.stderr, flush=True)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    lines = ["| system | cold compile cache: seconds to healthy (min / median / max) | warm cache |", "|---|---|---|"]
    lines += [f"| {s} | {spread(got[s]['cold'])} | {spread(got[s]['warm'])} |" for s in systems]
    table = "\n".join(lines)
    print(table)
    doc: dict[str, Any] = {"model": ns.model, "rounds": ns.rounds, "seconds": got, "table": table}
    (ns.out / "bench_start.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
