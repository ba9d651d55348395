"""Benchmark: an update from disk (``POST /update_weights``) against vLLM's own in-place reload of the same checkpoint
and against reading the files.

Writes a random Qwen3 of a few hundred MB (fp32) plus two trainer-style step directories, then starts both systems:
tito (``/update_weights``) and vLLM's own server (``VLLM_SERVER_DEV_MODE=1``, ``/collective_rpc`` ``reload_weights``
with ``weights_path``: what tito runs inside the worker, without tito's validation, pause/resume and prefix-cache
reset). After one untimed warm-up each, ``--repeat`` rounds alternate between the two steps; in each round both
systems load (the order alternates), so a slow spell of a noisy machine falls on both. Each load is timed end to end
from the client, with the CPU time of the server's processes (API + engine). tito's answer also says how long vLLM's
reload took inside it (``reload_seconds``): the rest is tito's own part. The read baseline reads every byte of the
same files (page cache warm, as the loads' are). Goals: tito / vLLM <= 1.05, tito / read <= 1.5 (best of runs).

``--profile`` also samples the engine process with py-spy (``pip install py-spy``) during each system's timed loads and
reports the share of the reload spent re-processing the loaded layers (``process_weights_after_loading``; on CPU that
is where vLLM re-packs every linear weight for oneDNN).

    python -m benchmarks weights [--workdir /tmp/tito-bench] [--repeat 5] [--systems tito,vllm] [--profile]

``--delta`` instead benchmarks staged sparse-delta updates against full updates of the same steps
(benchmarks/delta.py: commit pause, and generation throughput while a stage uploads).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from benchmarks.probes import Spy, collapsed, engine_pid, tree_cpu_s
from benchmarks.servers import start

# ~300 MB in fp32: 2 x 32000x768 embeddings + 4 layers.
BENCH_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 32000, "hidden_size": 768,
    "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 12, "num_key_value_heads": 4,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", "use_cache": True, "use_sliding_window": False,
}
# Frames of the reload as py-spy names them (vLLM 0.32): the whole reload, and the re-processing after loading.
RELOAD_FRAME = "reload_weights ("
PROCESS_FRAME = "process_weights_after_loading ("
ONEDNN_FRAMES = ("dispatch_cpu_unquantized_gemm (", "create_onednn_mm (")


def write_checkpoints(work: Path) -> tuple[Path, list[Path]]:
    from safetensors.torch import save_file

    from app.tiny.model import tiny_state_dict

    model = work / "model"
    steps = [work / "step_1", work / "step_2"]
    for i, d in enumerate([model, *steps]):
        if (d / "model.safetensors").exists():
            continue
        d.mkdir(parents=True, exist_ok=True)
        save_file(tiny_state_dict(100 + i, BENCH_CONFIG), str(d / "model.safetensors"))
    (model / "config.json").write_text(json.dumps(BENCH_CONFIG))
    return model, steps


def read_all(d: Path) -> float:
    t0 = time.perf_counter()
    for f in sorted(d.glob("*.safetensors")):
        with f.open("rb") as fh:
            while fh.read(64 << 20):
                pass
    return time.perf_counter() - t0


def reload_shares(stacks: Path) -> dict[str, float] | None:
    """Of the samples inside vLLM's reload: the share re-processing layers, and the share of that in oneDNN packing."""
    c: Counter[str] = Counter()
    for stack, n in collapsed(stacks):
        if RELOAD_FRAME not in stack:
            continue
        c["reload"] += n
        if PROCESS_FRAME in stack:
            c["process"] += n
            if any(f in stack for f in ONEDNN_FRAMES):
                c["onednn"] += n
    if not c["reload"]:
        return None
    return {"samples": c["reload"], "process_share": c["process"] / c["reload"],
            "onednn_share": c["onednn"] / c["reload"]}


class System:
    """One server of the comparison, started before the timed loads and stopped after."""

    def __init__(self, name: str, model: Path, work: Path) -> None:
        from tests.helpers import engine_env, free_port, tito_cmd, vllm_cmd

        self.name = name
        port = free_port()
        if name == "tito":
            cmd = tito_cmd(model, port, "--max-model-len", "512", "--allowed-weight-root", str(work))
            env = engine_env()
        else:
            cmd = vllm_cmd(model, port)  # max_model_len 512, eager, fp32: tito's settings on CPU
            env = engine_env({"VLLM_SERVER_DEV_MODE": "1"})  # mounts /collective_rpc
        self.server = start(cmd, port, work / f"{name}.log", env, 600)
        self.pid = self.server.proc.pid
        self.client = httpx.Client(base_url=self.server.url, timeout=600)
        self.loads: list[float] = []
        self.cpus: list[float] = []
        self.reloads: list[float] = []  # tito: vLLM's reload inside the same update (its answer's reload_seconds)

    def load(self, d: Path, tag: str) -> float | None:
        """One load of ``d``; tito's answer says how long vLLM's reload took inside it (None for vLLM's server)."""
        if self.name == "tito":
            r = self.client.post("/update_weights", json={"weight_dir": str(d), "weight_version": f"bench-{tag}"})
            assert r.status_code == 200, r.text
            return float(r.json()["reload_seconds"])
        r = self.client.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(d)}})
        assert r.status_code == 200, r.text
        return None

    def timed(self, d: Path, tag: str) -> None:
        c0, t0 = tree_cpu_s(self.pid), time.perf_counter()
        inner = self.load(d, tag)
        self.loads.append(time.perf_counter() - t0)
        self.cpus.append(tree_cpu_s(self.pid) - c0)
        if inner is not None:
            self.reloads.append(inner)

    def stop(self) -> None:
        self.client.close()
        self.server.stop()

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"best_s": min(self.loads), "median_s": statistics.median(self.loads),
                               "cpu_s": statistics.median(self.cpus), "runs_s": self.loads}
        if self.reloads:
            own = [t - r for t, r in zip(self.loads, self.reloads, strict=True)]
            out.update(reload_median_s=statistics.median(self.reloads), own_median_s=statistics.median(own),
                       own_share=statistics.median(o / r for o, r in zip(own, self.reloads, strict=True)))
        return out


def run(systems: list[str], model: Path, steps: list[Path], work: Path, repeat: int,
        profile: bool) -> tuple[dict[str, Any], list[float]]:
    """Every system up at once; the timed loads interleave (the order alternates each round), so a slow spell of
    the machine falls on both. Each round re-reads the step's files first, as the page-cache-warm baseline."""
    up: list[System] = []
    reads: list[float] = []
    with contextlib.ExitStack() as stack:
        for name in systems:
            up.append(System(name, model, work))
            stack.callback(up[-1].stop)
        for s in up:
            s.load(steps[1], "warm")  # the first load of a server pays one-time costs
        if profile:
            for s in up:
                stack.enter_context(Spy(engine_pid(s.pid), work / f"{s.name}.stacks"))
        for i in range(repeat):
            d = steps[i % 2]
            for s in (up if i % 2 == 0 else up[::-1]):
                reads.append(read_all(d))
                s.timed(d, f"{i}")
                print(f"{s.name} run {i}: {s.loads[-1]:.3f}s, cpu {s.cpus[-1]:.2f}s, read {reads[-1]:.3f}s",
                      file=sys.stderr)
    res = {s.name: s.result() for s in up}
    if profile:
        for s in up:
            res[s.name]["profile"] = reload_shares(work / f"{s.name}.stacks")
    return res, reads


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks weights", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/tito-bench-weights"))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--systems", default="tito,vllm", help="Comma-separated subset of tito,vllm.")
    p.add_argument("--profile", action="store_true", help="Sample the engine with py-spy: re-processing share.")
    p.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    p.add_argument("--delta", action="store_true", help="Staged deltas vs full updates (benchmarks/delta.py).")
    p.add_argument("--blocks", type=int, default=2, help="--delta: alternating blocks of --repeat steps each.")
    p.add_argument("--streams", type=int, default=4, help="--delta: closed-loop generating clients.")
    p.add_argument("--transport", default="streaming", help="--delta: path, multipart, chunked or streaming.")
    p.add_argument("--fraction", type=float, default=0.02, help="--delta: share of elements a step changes.")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.delta:
        from benchmarks import delta

        res = delta.run(a.workdir, a.repeat, a.blocks, a.streams, a.transport, a.fraction)
        delta.report(res)
        if a.json:
            a.json.write_text(json.dumps(res, indent=2))
        return 0
    model, steps = write_checkpoints(a.workdir)
    size = (steps[0] / "model.safetensors").stat().st_size
    res, reads = run([s for s in a.systems.split(",") if s], model, steps, a.workdir, a.repeat, a.profile)
    read = min(reads)
    names = {"tito": "tito POST /update_weights", "vllm": "vLLM /collective_rpc reload_weights"}
    print(f"\nweight update, checkpoint {size / 1e6:.0f} MB fp32, {a.repeat} runs per system (one warm-up before), "
          "systems up together, loads interleaved")
    print(f"{'system':<38} {'best s':>7} {'median s':>8} {'cpu s/update':>12} {'/ read':>7}")
    for s, r in res.items():
        print(f"{names[s]:<38} {r['best_s']:7.3f} {r['median_s']:8.3f} {r['cpu_s']:12.2f} {r['best_s'] / read:7.2f}")
    print(f"{'read the files (page cache warm)':<38} {read:7.3f}")
    if "tito" in res and "vllm" in res:
        t, v = res["tito"], res["vllm"]
        print(f"tito / vLLM: best {t['best_s'] / v['best_s']:.3f}, median {t['median_s'] / v['median_s']:.3f} "
              f"(goal <= 1.05); tito / read {t['best_s'] / read:.2f} (goal <= 1.5)")
    if "tito" in res:
        t = res["tito"]
        print(f"inside tito's updates: vLLM's reload {t['reload_median_s']:.3f}s, tito's own part (validation, "
              f"pause/resume, prefix-cache reset, HTTP) {t['own_median_s']:.3f}s = {t['own_share']:.1%} of the reload "
              "(median)")
    for s, r in res.items():
        prof = r.get("profile")
        if prof:
            print(f"{names[s]}: of the reload's {prof['samples']} py-spy samples, {prof['process_share']:.0%} "
                  f"re-process the loaded layers, {prof['onednn_share']:.0%} in oneDNN weight packing")
    if a.json:
        a.json.write_text(json.dumps({"checkpoint_bytes": size, "read_s": read, "systems": res}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
