"""A stand-in for Prime-RL's trainer process on a CPU: what the orchestrator sees is Prime-RL's own.

Prime-RL's trainer (``prime_rl.trainer.rl.train``) moves every tensor to CUDA unconditionally, so it cannot run here.
This process takes its place with Prime-RL's own parts wherever the orchestrator can see the difference:

- its config: ``trainer @ trainer.json``, the file Prime-RL's ``rl`` launcher writes, parsed by Prime-RL's
  ``TrainerConfig`` (output directory, max steps, rollout transport, weight broadcast, learning rate);
- its batches: Prime-RL's ``DataLoader`` over Prime-RL's micro-batch receiver (ZMQ or filesystem, as configured);
- its weights: Prime-RL's ``FileSystemWeightBroadcast`` (HF names, ``STABLE`` marker), step 0 at start-up and each
  step after its optimizer step, on an FSDP2-sharded model as Prime-RL shards it.

What it does not do as Prime-RL does: the loss. Each step is one real AdamW step on CPU of a plain importance-weighted
policy gradient (``-advantage * ratio`` over the loss mask, the packed samples forwarded as one padded batch), with no
clipping, KL or entropy terms; the checkpointing, metrics server and W&B logging are left out.

The trainer keeps float32 weights, rounded to what Prime-RL's writer saves (bf16) after each broadcast, sharded and
mixed-precision as Prime-RL's trainer does (FSDP2 per transformer block, compute in the checkpoint's dtype): bf16 at a
real shape, as tito serves it, which fits a step at Qwen3-0.6B's shape beside tito and keeps it within Prime-RL's
one-step lag on a CPU; float32 on the tiny float32 model. It also records, per step,
what tito must reproduce (``<output_dir>/tito-trainer/step_<k>.json``): the largest gap
between the logprobs tito returned with the batch and the trainer's own logprobs of the same tokens under the
weights the rollout was sampled from (when those are the trainer's current weights), and the trainer's greedy tokens
for a probe prompt under the weights it just wrote, so a run can check that tito serves exactly that step.

    python scripts/prime_run/trainer.py @ <run>/configs/trainer.json [--model-dir DIR] [--probe-tokens 1,2,3]
        [--probe-len 8] [--train-layers N]

``--model-dir``: where the model's files are when ``model.name`` (the name Prime-RL's configs share with the served
model, which its launcher requires to be the same for trainer and orchestrator) is not a directory here.
``--train-layers N``: train only the last N transformer blocks and the final norm (default 0: all of the model, as
Prime-RL trains it). ``make seed-run`` trains the last 2 at Qwen3-0.6B's shape: on 2 CPU cores shared with tito's
engine a whole-model step is slower than the orchestrator's next batch, so Prime-RL's one-step lag would leave the
last version unapplied.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PROBE = [1, 17, 300, 42, 9, 5]


def _pop_option(argv: list[str], name: str, default: str) -> str:
    if name in argv:
        at = argv.index(name)
        value = argv[at + 1]
        del argv[at:at + 2]
        return value
    return default


def main() -> int:
    argv = sys.argv[1:]
    probe = [int(t) for t in _pop_option(argv, "--probe-tokens", ",".join(map(str, PROBE))).split(",")]
    probe_len = int(_pop_option(argv, "--probe-len", "8"))
    model_dir = _pop_option(argv, "--model-dir", "")
    train_layers = int(_pop_option(argv, "--train-layers", "0"))
    threads = int(_pop_option(argv, "--threads", "0"))
    sys.argv = [sys.argv[0], *argv]

    import torch
    import torch.distributed as dist
    from prime_rl.configs.trainer import TrainerConfig
    from prime_rl.trainer.rl.data import DataLoader
    from prime_rl.transports.weights.filesystem import FileSystemWeightBroadcast
    from prime_rl.utils.config import cli
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    if threads > 0:
        torch.set_num_threads(threads)
    config = cli(TrainerConfig)
    if config.weight_broadcast.type != "filesystem":
        print(f"stand-in trainer: weight_broadcast.type={config.weight_broadcast.type!r}: only the filesystem "
              "broadcast runs on a CPU", file=sys.stderr)
        return 2
    out = Path(config.output_dir)
    records = out / "tito-trainer"
    records.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)

    model_dir = model_dir or config.model.name  # the served name need not be a directory here
    # float32 weights, as Prime-RL's trainer keeps its (sharded) master weights; its writer saves them in bf16. A bf16
    # model here would hand that writer a tied head that shares the embedding's memory, which safetensors refuses.
    # Sharded as Prime-RL shards it (its setup_fsdp: each transformer block, then the root, which keeps a tied head
    # with its embedding), with its mixed precision: the forward and backward in the checkpoint's dtype, as tito serves
    # it (dtype auto), gradients reduced in float32. bf16 for a bf16 checkpoint (a real shape: the CPU's bf16 matmuls;
    # only one block's unsharded weights at a time, so a 0.6B step fits beside tito), float32 for a float32 one (the
    # tiny model, where the suite checks the trainer's logprobs against tito's to 1e-4).
    dtype = torch.float32
    compute = AutoConfig.from_pretrained(model_dir).dtype or torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.train()
    trained = _freeze_below(model, train_layers)
    mesh = init_device_mesh("cpu", (1,))
    precision = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=precision)
    fully_shard(model, mesh=mesh, mp_policy=precision)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.optim.lr,
                                  weight_decay=0.0, fused=True)
    broadcast = FileSystemWeightBroadcast(out, config.weight_broadcast)
    _log(f"model {model_dir} ({dtype} weights, {compute} compute), training {trained}, lr {config.optim.lr}, "
         f"max_steps {config.max_steps}, rollouts over {config.rollout_transport.type}")

    def publish(step: int, **stats: Any) -> None:
        """Write ``step`` with Prime-RL's writer, keep computing on the values written, record it with the probe."""
        t = time.perf_counter()
        broadcast.broadcast_weights(model, step=step)
        _as_written(model)
        written = time.perf_counter() - t
        greedy = _greedy(model, probe, probe_len)
        _record(records / f"step_{step}.json", {"step": step, "write_s": written, **stats, "probe": probe,
                                                "probe_greedy": greedy})

    publish(0)  # the startup policy, as Prime-RL's trainer broadcasts v0
    _log("wrote step 0")

    loader = DataLoader(out, 1, 1, config.rollout_transport)
    step = 1
    while config.max_steps is None or step <= config.max_steps:
        t0 = time.perf_counter()
        loader.wait_for_batch()
        micro_batches = loader.get_batch()
        waited = time.perf_counter() - t0
        t1 = time.perf_counter()
        stats = _train_step(model, optimizer, micro_batches)
        publish(step, wait_s=waited, train_s=time.perf_counter() - t1, **stats)
        _log(f"step {step}: {stats['samples']} samples, {stats['loss_tokens']} loss tokens, loss {stats['loss']:.4f}, "
             f"logprob gap to tito {stats['max_logprob_gap']:.2e}; wrote step {step}")
        step += 1
    dist.destroy_process_group()
    return 0


FIELDS = ("input_ids", "loss_mask", "temperatures", "advantages", "inference_logprobs")
PAD = {"input_ids": 0, "loss_mask": False, "temperatures": 1.0, "advantages": 0.0, "inference_logprobs": 0.0}


def _train_step(model: Any, optimizer: Any, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
    """One optimizer step over every micro batch: the packed samples unpacked and forwarded together as one padded
    batch (right-padded with an attention mask, so no sample attends to another's tokens, as Prime-RL's varlen
    attention keeps them apart), loss -advantage * exp(logp - logp.detach()) over the loss mask, tokens averaged.
    The gap to tito: |trainer logprob - inference logprob| before the step, over the loss mask."""
    import torch

    samples = []
    for mb in micro_batches:
        start = 0
        for length in mb["sequence_lengths"]:
            samples.append({k: mb[k][0, start:start + length] for k in FIELDS})
            start += length
    total_tokens = sum(int(s["loss_mask"].sum()) for s in samples)
    trained = [s for s in samples if s["loss_mask"][1:].any()]
    optimizer.zero_grad(set_to_none=True)
    loss_value = gap = 0.0
    if trained:
        width = max(len(s["input_ids"]) for s in trained)
        batch = {k: torch.stack([torch.nn.functional.pad(s[k], (0, width - len(s[k])), value=PAD[k])
                                 for s in trained]) for k in FIELDS}
        attention = torch.stack([torch.arange(width) < len(s["input_ids"]) for s in trained]).long()
        ids, mask = batch["input_ids"], batch["loss_mask"][:, 1:].bool()
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        logits = logits.float() / batch["temperatures"][:, 1:, None]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        gap = float((logp.detach() - batch["inference_logprobs"][:, 1:])[mask].abs().max())
        ratio = torch.exp(logp - logp.detach())
        loss = -(batch["advantages"][:, 1:] * ratio)[mask].sum() / max(total_tokens, 1)
        loss.backward()
        loss_value = float(loss.detach())
    optimizer.step()
    return {"samples": len(samples), "loss_tokens": total_tokens, "loss": loss_value, "max_logprob_gap": gap}


def _freeze_below(model: Any, layers: int) -> str:
    """Train only the last ``layers`` transformer blocks and the final norm (0: every parameter, as Prime-RL does).
    The frozen blocks then run forward only: no activations kept, no backward through them, no optimizer state. What
    tito sees is the same either way, a whole checkpoint per step."""
    blocks = model.model.layers
    if layers <= 0 or layers >= len(blocks):
        return f"all {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters"
    for p in model.parameters():
        p.requires_grad_(False)
    for module in [*blocks[len(blocks) - layers:], model.model.norm]:
        for p in module.parameters():
            p.requires_grad_(True)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"the last {layers} of {len(blocks)} blocks and the final norm ({n / 1e6:.0f} M parameters)"


def _as_written(model: Any) -> None:
    """Round the weights to what the broadcast wrote: Prime-RL's writer saves sharded (DTensor) weights in bf16, so a
    float32 model is served with bf16-rounded values; the trainer keeps computing on exactly those, so its logprobs
    and probe are the served model's."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """The trainer's greedy continuation of ``prompt`` under its current weights (no KV cache: a few tokens). The
    sharded weights are gathered once for all ``n`` forwards, not once per forward, then sharded again."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    ids = list(prompt)
    model.set_reshard_after_forward(False)
    try:
        with torch.no_grad():
            for _ in range(n):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                ids.append(int(logits.argmax()))
    finally:
        model.set_reshard_after_forward(True)
        for unit in model.modules():  # reshard() is not recursive
            if isinstance(unit, FSDPModule):
                unit.reshard()
    return ids[len(prompt):]


def _record(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    tmp.replace(path)


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} stand-in trainer: {msg}", flush=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
