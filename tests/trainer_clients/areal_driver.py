"""AReaL 1.0.4's ``RemotevLLMEngine``, unchanged, against tito, playing AReaL's trainer around it (tests/test_areal.py).

Runs in AReaL's own venv (``make areal``). The trainer's side of each weight update is AReaL's own code: the disk path
writes the checkpoint and posts its name_resolve key as ``FSDPEngine._update_weights_from_disk`` does; the xccl path
builds its group with ``areal.engine.core.distributed.init_custom_process_group`` (rank 0, gloo) and broadcasts each
announced tensor as ``FSDPEngine._update_bucket_weights_from_distributed`` does. Usage:

    areal_driver.py <server url> <plan.json>

``plan.json``: {"mode": "full" | "lora", "ckpts": [dirs of new weights, in order], "lora_name": ..., "fileroot": ...}.
Prints one ``REPORT {...}`` line (tests/trainer_clients/common.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time
import urllib.request
from typing import Any

from common import REPORT, emit, step

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
LONG_PROMPT = [7, 7, 3, 9]
LONG_N = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def inflight(url: str) -> int:
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return int(json.loads(r.read())["inflight"])


def generated(url: str) -> float:
    """Tokens the engine has generated so far, all requests (vllm:generation_tokens_total)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:generation_tokens_total"))


def main() -> None:
    url, plan = sys.argv[1], json.loads(open(sys.argv[2]).read())
    import torch
    import torch.distributed as dist
    from areal.api import ModelRequest, ParamSpec, WeightUpdateMeta
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig
    from areal.api.workflow_api import RolloutWorkflow
    from areal.engine.core.distributed import init_custom_process_group
    from areal.engine.vllm_remote import RemotevLLMEngine
    from areal.utils import name_resolve, names
    from safetensors.torch import load_file

    lora = plan["mode"] == "lora"
    exp, trial = "tito", f"t{os.getpid()}"
    # AReaL's trainer posts "checkpoint saved" through name_resolve; the disk update waits for it.
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=os.path.join(plan["fileroot"], "nr")))
    config = InferenceEngineConfig(experiment_name=exp, trial_name=trial, backend="vllm:d1", request_timeout=300,
                                   setup_timeout=60, request_retries=3, pause_grace_period=0.5,
                                   max_concurrent_rollouts=4, consumer_batch_size=2, max_head_offpolicyness=100,
                                   use_lora=lora,
                                   lora_name=plan.get("lora_name", ""))
    engine = RemotevLLMEngine(config)
    addr = url.removeprefix("http://")
    step("initialize", lambda: engine.initialize(addr=addr) and None)

    def greedy(prompt: list[int], n: int, ignore_eos: bool = False) -> dict[str, Any]:
        req = ModelRequest(input_ids=list(prompt),
                           gconfig=GenerationHyperparameters(greedy=True, max_new_tokens=n, max_tokens=4096,
                                                             ignore_eos=ignore_eos,
                                                             lora_name=plan.get("lora_name", "")))
        resp = asyncio.run(engine.agenerate(req))
        return {"tokens": list(resp.output_tokens), "logprobs": list(resp.output_logprobs),
                "versions": list(resp.output_versions), "stop_reason": resp.stop_reason}

    if lora:
        # AReaL serves LoRA under "<name>-v<version>": version 0 first, from the disk path (/v1/load_lora_adapter).
        def load_lora(version: int, path: str) -> None:
            meta = WeightUpdateMeta(type="disk", path=path, use_lora=True, lora_name=plan["lora_name"],
                                    clear_checkpoint_after_load=False, version=version)
            engine.set_version(version)
            fut = engine.update_weights_from_disk(meta)
            name_resolve.add(names.update_weights_from_disk(exp, trial, version), str(time.time()),
                             keepalive_ttl=120, replace=True)
            fut.result(timeout=300)

        step("update_weights_from_disk_lora", lambda: load_lora(0, plan["ckpts"][0]))
        step("agenerate_lora_v0", lambda: greedy(PROMPT, 8))
    else:
        step("agenerate", lambda: greedy(PROMPT, 8))

        def logp() -> list[float]:
            ids = torch.tensor([PROMPT + [11, 12, 13]])
            mask = torch.tensor([[0] * len(PROMPT) + [1, 1, 1]])
            return [float(x) for x in engine.compute_logp([{"input_ids": ids, "loss_mask": mask}])[0][0][-3:]]

        step("compute_logp", logp)

        class Greedy(RolloutWorkflow):
            async def arun_episode(self, eng: Any, data: dict[str, Any]) -> dict[str, Any]:
                req = ModelRequest(input_ids=list(data["ids"]),
                                   gconfig=GenerationHyperparameters(greedy=True, max_new_tokens=6, max_tokens=4096))
                r = await eng.agenerate(req)
                seq = list(r.input_tokens) + list(r.output_tokens)
                return {"input_ids": torch.tensor([seq]), "attention_mask": torch.ones(1, len(seq), dtype=torch.bool),
                        "out": torch.tensor([list(r.output_tokens)])}

        def batch() -> list[list[int]]:
            out = engine.rollout_batch([{"ids": PROMPT}, {"ids": LONG_PROMPT}], workflow=Greedy())
            return [t["out"][0].tolist() for t in out]

        step("rollout_batch", batch)

        def submit_wait() -> list[list[int]]:
            engine.submit({"ids": PROMPT}, workflow=Greedy())
            return [t["out"][0].tolist() for t in engine.wait(1, timeout=120)]

        step("submit_wait", submit_wait)
        step("pause_resume", lambda: (engine.pause(), engine.resume()) and None)

        # A long rollout, cut by pause_generation mid-way; new weights from disk; continue: AReaL resubmits it.
        def cut_rollout() -> dict[str, Any]:
            box: dict[str, Any] = {}
            before = generated(url)  # nothing else runs on the server meanwhile
            t = threading.Thread(target=lambda: box.update(greedy(LONG_PROMPT, LONG_N, ignore_eos=True)))
            t.start()
            deadline = time.monotonic() + 60
            # Admitted, and some tokens generated on the old weights first.
            while inflight(url) < 1 or generated(url) < before + 8:
                assert time.monotonic() < deadline and t.is_alive(), "the rollout made no progress on the server"
                time.sleep(0.02)
            engine.pause_generation()
            try:
                meta = WeightUpdateMeta(type="disk", path=plan["ckpts"][0], clear_checkpoint_after_load=False)
                fut = engine.update_weights_from_disk(meta)
                name_resolve.add(names.update_weights_from_disk(exp, trial, engine.get_version()), str(time.time()),
                                 keepalive_ttl=120, replace=True)
                fut.result(timeout=300)
                engine.set_version(1)
            finally:
                engine.continue_generation()
            t.join(300)
            assert not t.is_alive(), "the resubmitted rollout did not finish"
            return box

        step("pause_generation_update_from_disk", cut_rollout)
        step("agenerate_after_disk_update", lambda: greedy(PROMPT, 8))

    # ---------------------------------------------------------------- xccl (AReaL's default weight sync)
    port = free_port()
    meta = WeightUpdateMeta.from_fsdp_xccl(gen_allocation=ModelAllocation.from_str("vllm:d1", name="rollout"),
                                           use_lora=lora, lora_name=plan.get("lora_name", ""), lora_int_id=1,
                                           base_model_name="base")
    meta.nccl_master_address, meta.nccl_master_port, meta.nccl_group_name = "127.0.0.1", port, "update_weight_group"
    groups: list[Any] = []

    def init_group() -> None:
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        if not dist.is_initialized():  # the trainer's own world (torchrun's); one rank here
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        fut = engine.init_weights_update_group(meta)
        pg = init_custom_process_group(backend="gloo", world_size=2, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                       group_name="update_weight_group")
        groups.append(pg)
        fut.result(timeout=300)

    step("init_weights_update_group", init_group)

    def xccl(version: int, path: str, buckets: int) -> None:
        tensors = sorted(load_file(os.path.join(path, "adapter_model.safetensors" if lora else "model.safetensors"))
                         .items())
        if lora:  # the trainer's PEFT names carry the adapter name
            tensors = [(n.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."), t)
                       for n, t in tensors]
            cfg = json.loads(open(os.path.join(path, "adapter_config.json")).read())
            meta.peft_config = {"r": cfg["r"], "lora_alpha": cfg["lora_alpha"], "target_modules": cfg["target_modules"],
                                "bias": "none"}
        meta.version = version
        engine.pause_generation()
        try:
            size = (len(tensors) + buckets - 1) // buckets
            for i in range(0, len(tensors), size):
                part = tensors[i:i + size]
                specs = [ParamSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).split("torch.")[1])
                         for n, t in part]
                fut = engine.update_weights_from_distributed(meta, specs)
                for _, t in part:
                    dist.broadcast(t.contiguous(), src=0, group=groups[0])
                fut.result(timeout=300)
            engine.set_version(version)
        finally:
            engine.continue_generation()

    if lora:
        step("update_weights_from_distributed_lora", lambda: xccl(1, plan["ckpts"][1], 1))
        step("agenerate_lora_v1", lambda: greedy(PROMPT, 8))
        step("update_weights_from_distributed_lora_2", lambda: xccl(2, plan["ckpts"][2], 1))
        step("agenerate_lora_v2", lambda: greedy(PROMPT, 8))
    else:
        step("update_weights_from_distributed", lambda: xccl(2, plan["ckpts"][1], 2))
        step("agenerate_after_xccl", lambda: greedy(PROMPT, 8))
    step("pause_generation", engine.pause_generation)
    step("continue_generation", engine.continue_generation)
    step("destroy", engine.destroy)
    REPORT["_version"] = {"ok": True, "value": engine.get_version()}
    emit()


if __name__ == "__main__":
    main()
