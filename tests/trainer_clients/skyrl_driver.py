"""Drives SkyRL 0.4's inference clients, unchanged, against a server: ``python skyrl_driver.py URL MODEL``.

``python skyrl_driver.py URL MODEL score``: Tinker's ``sample`` with prompt logprobs only (MODEL: a LoRA adapter's
name on a LoRA server).

``RemoteInferenceClient`` (generation, Tinker ``sample``, OpenAI routes, (de)tokenize, the control plane) and
``SkyrlWeightSyncClient`` (the trainer-side weight-sync control plane). Prints a JSON report
(tests/test_trainers.py checks it)."""

from __future__ import annotations

import asyncio
import sys

from common import barrier, emit, step  # type: ignore[import-not-found]

PROMPT = [1, 2, 3, 4, 5]
CHAT = [{"role": "user", "content": "Hi there"}]


def main(url: str, model: str, mode: str = "") -> None:
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import PauseMode, RemoteInferenceClient
    from skyrl.backends.skyrl_train.weight_sync.control_plane import SkyrlWeightSyncClient

    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model)
    loop = asyncio.new_event_loop()

    def run(coro_fn):  # noqa: ANN001, ANN202
        return lambda: loop.run_until_complete(coro_fn())

    step("get_world_size", run(client.get_world_size))
    step("generate", run(lambda: client.generate({"prompt_token_ids": [PROMPT, [9, 10, 11]], "sampling_params": {
        "max_tokens": 6, "temperature": 0.0, "logprobs": 0}})))
    step("sample", run(lambda: client.sample({"json": {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}, "num_samples": 2,
        "sampling_params": {"temperature": 1.0, "max_tokens": 6, "seed": 42},
        "include_prompt_logprobs": True, "topk_prompt_logprobs": 2}})))
    if mode == "score":
        barrier()
        loop.run_until_complete(client.teardown())
        loop.close()
        return
    step("completion", run(lambda: client.completion({"json": {
        "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "logprobs": 1, "return_token_ids": True}})))
    step("chat_completion", run(lambda: client.chat_completion({"json": {
        "messages": CHAT, "max_tokens": 6, "temperature": 0.0, "return_token_ids": True}})))
    step("render_chat_completion", run(lambda: client.render_chat_completion({"json": {"messages": CHAT}})))
    step("tokenize", run(lambda: client.tokenize(["Hello world", "Hi"])))
    step("detokenize", run(lambda: client.detokenize([[423, 289, 293, 323], [72, 101]])))
    barrier()
    step("pause_keep", run(lambda: client.pause(mode=PauseMode.KEEP)))
    step("resume", run(client.resume))
    step("pause_abort", run(lambda: client.pause(mode=PauseMode.ABORT, clear_cache=True)))
    step("resume_after_abort", run(client.resume))
    step("reset_prefix_cache", run(lambda: client.reset_prefix_cache(reset_running_requests=True)))
    # GPU-only or SkyRL's own server's routes: expected to fail here.
    step("sleep", run(lambda: client.sleep(level=1)))
    step("wake_up", run(client.wake_up))
    step("fetch_weights", run(lambda: client.fetch_weights(target_version=1)))
    step("load_lora_adapter", run(lambda: client.load_lora_adapter("skyrl-lora", "/nonexistent")))
    loop.run_until_complete(client.teardown())
    loop.close()

    sync = SkyrlWeightSyncClient([url])
    step("weight_sync.reset_prefix_cache", lambda: sync.reset_prefix_cache(reset_running_requests=True))
    step("weight_sync.pause_generation", sync.pause_generation)
    step("weight_sync.resume_generation", sync.resume_generation)
    step("weight_sync.init_weight_transfer_engine", lambda: sync.init_weight_transfer_engine(
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}))
    step("weight_sync.start_weight_update", sync.start_weight_update)
    step("weight_sync.finish_weight_update", sync.finish_weight_update)
    sync.close()


if __name__ == "__main__":
    try:
        main(*sys.argv[1:4])
    finally:
        emit()
