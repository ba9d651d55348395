"""Drives TRL 1.16's vLLM clients, unchanged, against a server: ``python trl_driver.py URL``.

``python trl_driver.py URL ADAPTER``: teacher scoring only (``get_sequence_logprobs``), by the base model and then by
the LoRA adapter ``ADAPTER`` (the client's ``model`` attribute, which every request sends, set to the adapter's name).

``trl.generation.vllm_client.VLLMClient`` (GRPOTrainer/RLOOTrainer with ``vllm_mode="server"``) and
``trl.experimental.async_grpo.vllm_client.VLLMClient`` (async GRPO). Every call a trainer makes, in the order it
makes them; prints a JSON report (tests/test_trainers.py checks it)."""

from __future__ import annotations

import sys
import warnings

from common import REPORT, barrier, emit, step  # type: ignore[import-not-found]

warnings.filterwarnings("ignore")  # trl warns that vLLM 0.32 is newer than the versions it lists


SEQ = [[1, 2, 3, 4, 5, 6, 7, 8]]


def main(url: str, adapter: str = "") -> None:
    from trl.experimental.async_grpo.vllm_client import VLLMClient as AsyncGRPOClient
    from trl.generation.vllm_client import VLLMClient

    client = step("init", lambda: VLLMClient(base_url=url, connection_timeout=60))
    if client is None:
        return
    REPORT["init"]["value"] = {"model": client.model}
    if adapter:
        step("get_sequence_logprobs", lambda: client.get_sequence_logprobs(SEQ, [4], top_logprobs=3))
        client.model = adapter
        step("get_sequence_logprobs.adapter", lambda: client.get_sequence_logprobs(SEQ, [4], top_logprobs=3))
        barrier()
        return

    def server_info() -> dict:
        cfg = client.get_server_info()
        return {"dtype": cfg["model_config"]["dtype"], "weight_transfer_config": cfg["weight_transfer_config"]}

    step("get_server_info", server_info)
    step("get_world_size", client.get_world_size)
    # Rollouts: token-id prompts, n samples each, seeded; TRL's own defaults for the rest.
    step("generate", lambda: client.generate([[1, 2, 3, 4, 5], [9, 10, 11]], n=2, temperature=1.0, max_tokens=6,
                                             logprobs=2, generation_kwargs={"seed": 1234}))
    step("generate_greedy", lambda: client.generate([[20, 21, 22, 23]], temperature=0.0, max_tokens=6, logprobs=0))
    step("generate_text", lambda: client.generate(["Hello world"], temperature=0.0, max_tokens=6, logprobs=0))
    step("chat", lambda: client.chat([[{"role": "user", "content": "Hi there"}]], temperature=0.0, max_tokens=6,
                                     logprobs=1))
    # Teacher scoring (distillation): prompt logprobs of whole sequences.
    step("get_sequence_logprobs", lambda: client.get_sequence_logprobs(SEQ, [4], top_logprobs=3))
    barrier()
    step("reset_prefix_cache", client.reset_prefix_cache)
    # Weight sync: vLLM's NCCL weight-transfer engine, which needs CUDA (a CPU server has none).
    step("init_communicator", lambda: client.init_communicator(device="cpu"))

    def weight_update() -> None:
        with client.weight_update():
            pass

    step("weight_update", weight_update)

    from accelerate import PartialState

    PartialState()  # the async GRPO trainer's process state, which its client's logger needs
    a = AsyncGRPOClient(url, server_timeout=60)
    step("async_grpo.wait_for_server_ready", a.wait_for_server_ready)
    step("async_grpo.get_max_model_len", a.get_max_model_len)
    step("async_grpo.get_dtype", a.get_dtype)
    step("async_grpo.get_world_size", a.get_world_size)
    step("async_grpo.pause", a.pause)
    step("async_grpo.resume", a.resume)
    step("async_grpo.init_weight_transfer_engine",
         lambda: a.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                                "world_size": 2}))
    step("async_grpo.start_weight_update", a.start_weight_update)
    step("async_grpo.finish_weight_update", a.finish_weight_update)


if __name__ == "__main__":
    try:
        main(*sys.argv[1:3])
    finally:
        emit()
