"""Seconds to healthy, with and without vLLM's compile cache: tito and vLLM's server at their defaults (both compile
on CPU), and tito with ``--enforce-eager``.

Each round gives each system fresh, empty compile caches (``VLLM_CACHE_ROOT`` and ``TORCHINDUCTOR_CACHE_DIR``: cold,
as on a new machine: torch.compile compiles the model and inductor its kernels) and then starts it once more on the
same caches (warm: vLLM reads the compiled graphs back). Systems alternate order round by
round. ``/health`` answering 200 is "healthy" for both servers (tito's /health answers once the engine is up).

    python -m benchmarks start --model models/qwen3-0.6b --rounds 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.report import spread
from benchmarks.servers import reverse_odd, server_cmd

SYSTEMS = ("tito", "eager", "vllm")


def start_seconds(system: str, model: str, max_model_len: int, cache: Path, log: Path, timeout: float) -> float:
    from tests.helpers import EAGER_ENV, ServerProcess, engine_env, free_port

    port = free_port()
    cmd = server_cmd(system, model, port, True, max_model_len=max_model_len)
    # Both caches a compile reads: vLLM's (its AOT-compiled graphs) and inductor's (kernels, shared across configs).
    env = engine_env({"VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
                      EAGER_ENV: None})
    server = ServerProcess(cmd, port, log, env=env)
    server.start(timeout=timeout)
    try:
        return ServerProcess.starts[-1].seconds
    finally:
        server.stop()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks start", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"Comma-separated subset of {','.join(SYSTEMS)}.")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--timeout", type=float, default=1200.0, help="Seconds one start may take.")
    p.add_argument("--out", type=Path, default=Path("results/bench_start"))
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    systems = [s for s in ns.systems.split(",") if s]
    ns.out.mkdir(parents=True, exist_ok=True)
    got: dict[str, dict[str, list[float]]] = {s: {"cold": [], "warm": []} for s in systems}
    for r in range(ns.rounds):
        for system in reverse_odd(systems, r):
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
    lines += [f"| {s} | {spread(got[s]['cold'], '{:.1f}')} | {spread(got[s]['warm'], '{:.1f}')} |" for s in systems]
    table = "\n".join(lines)
    print(table)
    doc: dict[str, Any] = {"model": ns.model, "rounds": ns.rounds, "seconds": got, "table": table}
    (ns.out / "bench_start.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
