"""Benchmark: staged sparse-delta updates (``/stage`` + ``/commit``) against a full ``/update_weights`` of the same
steps, on the ~300 MB fp32 bench model of benchmarks/weights.py, with generation running throughout.

A chain of training steps, each changing ~2% of every tensor's elements (scattered, as an optimizer step on bf16
weights does), is written as Prime-RL's trainer would: per step a ``delta.stream`` (sparse_delta_v2) and, for the
comparison, the full checkpoint. One tito serves the model while ``--streams`` clients generate closed-loop. Blocks
alternate: ``--repeat`` delta steps (stage over ``--transport`` while generating, then pause keep -> commit -> resume),
then ``--repeat`` full steps (pause keep -> /update_weights -> resume), ``--blocks`` times; a slow spell of the shared
machine falls on both. Measured per step:

- the pause, from the client (pause sent -> resume answered), and the server's CPU seconds in it (API + engine);
- for deltas, generation throughput during the stage call against the 1.5 s before it: tokens/s as the clients
  received them, and as the engine counted them (``vllm:generation_tokens_total``). A delta's stage answers once the
  workers have made it ready for its commit (on CPU: added to their copy and the touched layers processed ahead,
  app/engine/worker_prebuild.py; at most ``--stage-ready-wait``), and the commit follows at once, as Prime-RL's
  orchestrator does.
  A block's first stage also fills the workers' copy of the active weights: it is left out of the figures.

Goals: commit pause <= 0.5 x the full update's; throughput while staging >= 0.9 x without.

    python -m benchmarks weights --delta [--repeat 3] [--blocks 2] [--streams 4]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.clients import Streams
from benchmarks.probes import tree_cpu_s
from benchmarks.weights import BENCH_CONFIG, System, write_checkpoints


def write_chain(work: Path, n: int, fraction: float) -> tuple[Path, list[Path]]:
    """The model (bench_weights' seed 100) and ``n`` steps: step_k/delta.stream from step k-1, full checkpoint in
    step_k/full/model.safetensors."""
    import torch
    from safetensors.torch import save_file

    from app.tiny.model import tiny_state_dict
    from tests.delta_encoder import perturb, write_delta

    model, _ = write_checkpoints(work)
    sd: dict[str, torch.Tensor] = tiny_state_dict(100, BENCH_CONFIG)
    steps = []
    for k in range(1, n + 1):
        d = work / "chain" / f"step_{k}"
        target = perturb(sd, fraction, 1000 + k, scale=0.01)
        if not (d / "full" / "model.safetensors").exists():
            write_delta(d / "delta.stream", sd, target)
            (d / "full").mkdir(parents=True, exist_ok=True)
            save_file(target, str(d / "full" / "model.safetensors"))
        steps.append(d)
        sd = target
    return model, steps


def generated(c: httpx.Client) -> float:
    """Tokens the engine has generated so far (``vllm:generation_tokens_total``)."""
    from tests.helpers import metric_value

    return metric_value(c.get("/metrics").text, "vllm:generation_tokens_total") or 0.0


def paused(c: httpx.Client, pid: int, call: Any) -> dict[str, Any]:
    """pause (keep) -> ``call()`` -> resume, timed from the client, with the server's CPU seconds."""
    cpu0, t0 = tree_cpu_s(pid), time.perf_counter()
    assert c.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
    try:
        r = call()
        assert r.status_code == 200, r.text
    finally:
        assert c.post("/resume").status_code == 200
    return {"pause_s": time.perf_counter() - t0, "cpu_s": tree_cpu_s(pid) - cpu0, "answer": r.json()}


def run(work: Path, repeat: int, blocks: int, streams: int, transport: str, fraction: float) -> dict[str, Any]:
    model, steps = write_chain(work, 2 * repeat * blocks, fraction)
    delta_bytes = statistics.median((d / "delta.stream").stat().st_size for d in steps)
    full_bytes = (steps[0] / "full" / "model.safetensors").stat().st_size
    tito = System("tito", model, work)
    deltas: list[dict[str, Any]] = []
    fulls: list[dict[str, Any]] = []
    try:
        c = tito.client
        active = "base"
        with Streams(tito.server.url, streams, 48, route="tokens") as load:
            it = iter(enumerate(steps, start=1))
            for _ in range(blocks):
                for j in range(repeat):
                    k, d = next(it)
                    version = f"d{k}"
                    cpu_b, gen_b, t_b = tree_cpu_s(tito.pid), generated(c), time.monotonic()
                    time.sleep(1.5)
                    cpu0, gen0, t0 = tree_cpu_s(tito.pid), generated(c), time.monotonic()
                    # The stage answers once the workers have made the delta ready for its commit (CPU: its
                    # layers processed), at most --stage-ready-wait; Prime-RL commits as soon as it answers.
                    staged = asyncio.run(_stage(tito.server.url, d, version, active, transport))
                    t1, cpu1, gen1 = time.monotonic(), tree_cpu_s(tito.pid), generated(c)
                    prep = (c.get("/weight_status").json()["workers"][0].get("pending") or {})
                    row = {"step": k, "first_in_block": j == 0, "stage_s": t1 - t0, "ready": staged.get("ready"),
                           "prepare": prep,
                           "rate_before": load.rate(t0 - 1.5, t0), "rate_staging": load.rate(t0, t1),
                           "engine_rate_before": (gen0 - gen_b) / (t0 - t_b),
                           "engine_rate_staging": (gen1 - gen0) / (t1 - t0),
                           "cpu_rate_before": (cpu0 - cpu_b) / 1.5, "cpu_rate_staging": (cpu1 - cpu0) / (t1 - t0)}
                    row.update(paused(c, tito.pid, lambda v=version: c.post("/commit",
                                                                           data={"version": v, "mode": "delta"})))
                    deltas.append(row)
                    active = version
                    print(f"delta {k}: stage {row['stage_s']:.3f}s (ready: {row['ready']}, "
                          f"{prep.get('prebuilt')} layers processed, preparing took {prep.get('cpu_seconds')} "
                          f"CPU s; {row['rate_staging']:.0f} vs {row['rate_before']:.0f} tok/s), "
                          f"pause {row['pause_s']:.3f}s, cpu {row['cpu_s']:.2f}s")
                for _ in range(repeat):
                    k, d = next(it)
                    version = f"f{k}"
                    row = {"step": k, **paused(c, tito.pid, lambda d=d, v=version: c.post(
                        "/update_weights", json={"weight_dir": str(d / "full"), "weight_version": v}))}
                    fulls.append(row)
                    active = version
                    print(f"full {k}: pause {row['pause_s']:.3f}s, cpu {row['cpu_s']:.2f}s")
            errors = load.errors
    finally:
        tito.stop()
    timed = [r for r in deltas if not r["first_in_block"]] or deltas
    med = statistics.median
    return {"delta_bytes": delta_bytes, "full_bytes": full_bytes, "fraction": fraction, "streams": streams,
            "transport": transport, "load_errors": errors, "deltas": deltas, "fulls": fulls,
            "delta_pause_s": med(r["pause_s"] for r in timed), "full_pause_s": med(r["pause_s"] for r in fulls),
            "delta_cpu_s": med(r["cpu_s"] for r in timed), "full_cpu_s": med(r["cpu_s"] for r in fulls),
            "pause_ratio": med(r["pause_s"] for r in timed) / med(r["pause_s"] for r in fulls),
            "cpu_ratio": med(r["cpu_s"] for r in timed) / med(r["cpu_s"] for r in fulls),
            "staging_s": med(r["stage_s"] for r in timed), "ready": sum(bool(r["ready"]) for r in timed),
            "timed": len(timed), "prebuilt": med(float(r["prepare"].get("prebuilt") or 0) for r in timed),
            "throughput_ratio": med(r["rate_staging"] / r["rate_before"] for r in timed if r["rate_before"]),
            "engine_throughput_ratio": med(r["engine_rate_staging"] / r["engine_rate_before"] for r in timed
                                           if r["engine_rate_before"]),
            "server_cpu_rate_before": med(r["cpu_rate_before"] for r in timed),
            "server_cpu_rate_staging": med(r["cpu_rate_staging"] for r in timed),
            "commit_inplace_s": med(float(r["answer"].get("seconds", 0)) for r in timed)}


async def _stage(url: str, d: Path, version: str, base: str, transport: str) -> dict[str, Any]:
    from tests import prime_stage_client as prime

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        # Prime-RL's default chunk size
        return await prime.stage(c, d, version, base, transport, chunk_size=16 << 20, streams=2)


def report(res: dict[str, Any]) -> None:
    print(f"\nstaged delta vs full update: {res['fraction']:.0%} of the elements per step, delta "
          f"{res['delta_bytes'] / 1e6:.1f} MB ({res['transport']}), checkpoint {res['full_bytes'] / 1e6:.0f} MB fp32; "
          f"{len(res['fulls'])} steps each, {res['streams']} streams generating throughout")
    print(f"{'':28} {'pause median s':>14} {'server CPU s':>12}")
    print(f"{'full /update_weights':28} {res['full_pause_s']:14.3f} {res['full_cpu_s']:12.2f}")
    print(f"{'delta /commit':28} {res['delta_pause_s']:14.3f} {res['delta_cpu_s']:12.2f}")
    print(f"commit / full: pause {res['pause_ratio']:.2f}, CPU {res['cpu_ratio']:.2f} (goal <= 0.5)")
    print(f"generation while staging: {res['throughput_ratio']:.2f} x the 1.5 s before as the clients received it, "
          f"{res['engine_throughput_ratio']:.2f} x as the engine counted it (medians; goal >= 0.9); a stage took "
          f"{res['staging_s']:.3f}s (median; it answers once the workers have the delta ready for its commit: "
          f"{res['ready']} of {res['timed']} were, {res['prebuilt']:.0f} layers processed ahead); "
          f"{res['load_errors']} load errors")
    print(f"server CPU (cores busy): {res['server_cpu_rate_before']:.2f} before, {res['server_cpu_rate_staging']:.2f} "
          "while staging")
