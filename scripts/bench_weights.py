"""Benchmark: an update from disk (``POST /update_weights``) against reading the same files, as a ratio (goal <= 1.5).

Writes a random Qwen3 of a few hundred MB (fp32) plus two trainer-style step directories, starts tito on it, then
alternates updates between the two steps. The read baseline reads every byte of the same files (page cache warm,
as the update's are). Both are timed end to end; the best of ``--repeat`` runs is compared.

    .venv/bin/python scripts/bench_weights.py [--workdir /tmp/tito-bench] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# ~300 MB in fp32: 2 x 32000x768 embeddings + 4 layers.
BENCH_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 32000, "hidden_size": 768,
    "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 12, "num_key_value_heads": 4,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", "use_cache": True, "use_sliding_window": False,
}


def write_checkpoints(work: Path) -> tuple[Path, list[Path]]:
    from safetensors.torch import save_file

    from app.tiny_model import tiny_state_dict

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/tito-bench-weights"))
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    model, steps = write_checkpoints(a.workdir)
    size = (steps[0] / "model.safetensors").stat().st_size
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    log = (a.workdir / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--model", str(model), "--port", str(port),
                             "--dtype", "float32", "--max-model-len", "256", "--allowed-weight-root", str(a.workdir)],
                            cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start; see {a.workdir / 'server.log'}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        updates, reads = [], []
        with httpx.Client(base_url=url, timeout=600) as c:
            for i in range(a.repeat):
                d = steps[i % 2]
                reads.append(read_all(d))
                t0 = time.perf_counter()
                r = c.post("/update_weights", json={"weight_dir": str(d), "weight_version": f"bench-{i}"})
                updates.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
                print(f"run {i}: update {updates[-1]:.3f}s (server {r.json()['seconds']:.3f}s), "
                      f"read {reads[-1]:.3f}s")
        best_u, best_r = min(updates), min(reads)
        print(f"checkpoint {size / 1e6:.0f} MB: update {best_u:.3f}s, read {best_r:.3f}s, "
              f"ratio {best_u / best_r:.2f} (goal <= 1.5)")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
