"""Trainer-side sender of Prime-RL's weight broadcast (prime-rl-contract.md §2b), over gloo on CPU.

Rank 0 of ``world_size`` hosts the TCPStore; tito's workers join as ranks 1..N. Per update, once
``<step_dir>/NCCL_READY`` exists (the orchestrator touches it before calling ``/update_weights``), it broadcasts:
int64 [number of state dicts]; per state dict int64 [len(meta)], uint8 pickled ``{dtype: [(name, shape, numel)]}``,
then one flat tensor per dtype. Non-layer weights first, then one state dict per layer.

    python -m tests.weight_sender --port P --world-size 2 --seed 7 --step-dir DIR [--step-dir DIR2 ...]
    --mode stall: announce two state dicts, then send nothing (tests tito's timeout)
    --mode evil:  send a pickle that names os.system (tests the restricted unpickler)
    --mode die:   send the first --after state dicts of the update, then exit (a trainer that crashes mid-update)
    --mode stall-after: send the first --after state dicts, then nothing (a trainer that hangs mid-update)
    --tied: a tied model's state dict (lm_head.weight, a copy of model.embed_tokens.weight)
"""

from __future__ import annotations

import argparse
import os
import pickle
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

LAYER_PREFIX = "model.layers."


def _bcast(pg: Any, t: torch.Tensor) -> None:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    pg.broadcast([t], opts).wait()


def state_dicts(sd: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Prime-RL's order: everything outside the layers first, then layer 0, 1, ..."""
    rest = {k: v for k, v in sd.items() if not k.startswith(LAYER_PREFIX)}
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        if k.startswith(LAYER_PREFIX):
            layers.setdefault(int(k[len(LAYER_PREFIX):].split(".", 1)[0]), {})[k] = v
    return [rest] + [layers[i] for i in sorted(layers)]


def send_state_dicts(pg: Any, dicts: list[dict[str, torch.Tensor]], limit: int | None = None) -> None:
    """Announce all ``dicts``; send the first ``limit`` of them (all by default)."""
    _bcast(pg, torch.tensor([len(dicts)], dtype=torch.int64))
    for d in dicts[:limit]:
        groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for k, v in d.items():
            groups.setdefault(v.dtype, []).append((k, v))
        meta = {dt: [(k, v.shape, v.numel()) for k, v in items] for dt, items in groups.items()}
        raw = pickle.dumps(meta)
        _bcast(pg, torch.tensor([len(raw)], dtype=torch.int64))
        _bcast(pg, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        for _, items in groups.items():
            _bcast(pg, torch.cat([v.contiguous().view(-1) for _, v in items]))


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > /dev/null",))


def wait_ready(step_dir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (step_dir / "NCCL_READY").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {step_dir}/NCCL_READY after {timeout}s")
        time.sleep(0.05)


def main() -> int:
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    from app.tiny.model import tiny_state_dict

    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--world-size", type=int, default=2, help="inference_world_size + 1")
    p.add_argument("--seed", type=int, action="append", default=[], help="one per step dir")
    p.add_argument("--step-dir", type=Path, action="append", default=[])
    p.add_argument("--mode", choices=("ok", "stall", "evil", "die", "stall-after"), default="ok")
    p.add_argument("--after", type=int, default=2, help="state dicts sent before die / stall-after")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--tied", action="store_true", help="a tied model: the state dict names the embedding twice, as "
                   "lm_head.weight too (as a tied model's state_dict() does)")
    a = p.parse_args()
    pg: Any = stateless_init_torch_distributed_process_group(a.host, a.port, 0, a.world_size, "gloo",
                                                             timeout=timedelta(seconds=a.timeout))
    print("sender: group formed", flush=True)
    for i, step_dir in enumerate(a.step_dir):
        wait_ready(step_dir, a.timeout)
        if a.mode == "stall":
            _bcast(pg, torch.tensor([2], dtype=torch.int64))
            time.sleep(a.timeout)
            return 0
        if a.mode == "evil":
            _bcast(pg, torch.tensor([1], dtype=torch.int64))
            raw = pickle.dumps({torch.float32: [("x", _Evil(), 1)]})
            _bcast(pg, torch.tensor([len(raw)], dtype=torch.int64))
            _bcast(pg, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            return 0
        sd = tiny_state_dict(a.seed[i])
        if a.tied:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
        # A non-parameter buffer in a second dtype, as HF checkpoints of older trainers carry: must be skipped.
        sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.arange(32, dtype=torch.float64)
        if a.mode in ("die", "stall-after"):
            dicts = state_dicts(sd)
            send_state_dicts(pg, dicts, limit=a.after)
            print(f"sender: sent {a.after} of {len(dicts)} state dicts; mode {a.mode}", flush=True)
            if a.mode == "die":
                os._exit(3)  # no clean shutdown of the group: as a crashed trainer
            time.sleep(a.timeout)
            return 0
        send_state_dicts(pg, state_dicts(sd))
        print(f"sender: sent {step_dir.name}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
