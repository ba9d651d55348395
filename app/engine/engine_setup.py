"""The engine's configuration from tito's settings: ``AsyncEngineArgs`` as ``vllm serve`` builds them from the same
arguments (``engine_args``), with tito's CPU defaults under the arguments given, and vLLM's own check of them before
anything starts (``check_engine``). Whether the model's tokenizer is loaded, and whether this is a CPU, too."""

from __future__ import annotations

import argparse
import os
from typing import Any

from app.core.settings import Settings
from app.engine.multimodal import engine_kwargs as mm_engine_kwargs
from app.engine.multimodal import ships_processor


def has_tokenizer(model_dir: str) -> bool:
    """Whether the model directory carries a tokenizer (Dynamo's text frontends need one)."""
    return any(os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                      "tokenizer.model", "vocab.json"))


def loads_tokenizer(settings: Settings) -> bool:
    """Whether the engine loads the model directory's tokenizer: when the directory ships one, unless
    ``--skip-tokenizer-init``. Only the text routes use it (/v1/completions with text, chat, tokenize, detokenized
    output); the token API never detokenizes (its requests carry ``detokenize=False``, so vLLM's output processor
    skips the tokenizer for them) and keeps its cost with or without one."""
    if settings.skip_tokenizer_init is not None:
        return not settings.skip_tokenizer_init
    return has_tokenizer(settings.model)


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def cpu_safe_defaults(settings: Settings) -> dict[str, Any]:
    """Engine arguments that make ``tito serve --model DIR`` work on a CPU box with no environment set up.

    vLLM's defaults assume a GPU: 0.92 of memory fails on CPU ("Available memory on node 0 ... less than desired").
    The rest is vLLM's CPU default, as ``vllm serve`` runs it: torch.compile (at Qwen3-0.6B's shape it decodes
    13-16% faster than eager, and bounds a long prefill's step where eager outran vLLM's step timeout) and chunked
    prefill (a step of at most 2,048 tokens; seeded requests need tito's fix to vLLM's CPU rewind for it,
    app/engine/vllm_patches.py). Router replay on CPU captures only eagerly, so it implies ``--enforce-eager``.
    """
    if not on_cpu():  # vLLM's own defaults (0.92 of the GPU's memory) unless the flag is given
        given = settings.gpu_memory_utilization
        return {**({} if given is None else {"gpu_memory_utilization": given}), "enforce_eager": not compiles(settings)}
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{settings.kv_cache_space_gib:g}"
    return {"gpu_memory_utilization": settings.gpu_memory_utilization or 0.3, "enforce_eager": not compiles(settings)}


def compiles(settings: Settings) -> bool:
    """Whether the engine runs the model under torch.compile: vLLM's default, unless ``--enforce-eager`` (given, or
    implied on CPU by router replay)."""
    if settings.enforce_eager is not None:
        return not settings.enforce_eager
    return not (on_cpu() and settings.enable_return_routed_experts)


def engine_args(settings: Settings) -> Any:
    """``AsyncEngineArgs`` as ``vllm serve`` builds them from the same arguments, with tito's settings and its CPU
    defaults (``cpu_safe_defaults``) under the vLLM arguments given, and tito's worker extension over them."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from app.engine.vllm_args import engine_options

    kw: dict[str, Any] = dict(
        model=settings.model,
        served_model_name=list(settings.served_model_name or [settings.model]),
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        seed=settings.seed,
        data_parallel_size=settings.data_parallel_size,
        tensor_parallel_size=settings.tensor_parallel_size,
        enable_prefix_caching=settings.enable_prefix_caching,
        scheduling_policy=settings.scheduling_policy,
        max_logprobs=settings.max_logprobs,
        stream_interval=settings.stream_interval,
        skip_tokenizer_init=not loads_tokenizer(settings),
        enable_lora=settings.enable_lora,
        **cpu_safe_defaults(settings),
    )
    if settings.max_num_seqs:
        kw["max_num_seqs"] = settings.max_num_seqs
    if settings.num_kv_blocks:
        kw["num_gpu_blocks_override"] = settings.num_kv_blocks
    if settings.enable_lora:
        kw["max_lora_rank"] = settings.max_lora_rank
        kw["max_loras"] = settings.max_loras
        kw["max_cpu_loras"] = settings.max_cpu_loras or settings.max_loras
    if settings.enable_return_routed_experts:
        from app.engine.routed_experts import routed_experts_refusal
        from app.engine.vllm_args import ServeArgsError

        if refusal := routed_experts_refusal(settings):
            raise ServeArgsError(refusal)  # tito's own refusal, not vLLM's (check_engine says it as is)
        kw["enable_return_routed_experts"] = True
    if settings.weight_transfer_backend:
        kw["weight_transfer_config"] = {"backend": settings.weight_transfer_backend}
    if settings.block_size:
        kw["block_size"] = settings.block_size
    if settings.kv_events_port is not None:
        kw["kv_events_config"] = kv_events_config(settings.kv_events_port, settings.data_parallel_size)
    if loads_tokenizer(settings) and ships_processor(settings.model):
        # Multimodal: the processor needs the tokenizer (app/engine/multimodal.py).
        kw.update(mm_engine_kwargs(settings))
    kw.update(engine_options(settings))
    # tito's extension carries its weight updates and checks; its metrics and readiness read the engine's stats.
    kw.update(worker_extension_cls="app.engine.worker.TitoWorkerExtension", disable_log_stats=False)
    args = AsyncEngineArgs(**kw)
    from vllm.entrypoints.launchers.cli_args import propagate_flash_late_interaction

    propagate_flash_late_interaction(argparse.Namespace(**settings.vllm_args), args)
    return args


def check_engine(settings: Settings) -> None:
    """vLLM's own checks of the engine arguments (what this platform cannot run included), before anything starts:
    its message, in one line."""
    from pydantic import ValidationError

    from app.engine.vllm_args import ServeArgsError

    try:
        engine_args(settings).create_engine_config()
    except ServeArgsError:
        raise
    except ValidationError as e:
        raise ServeArgsError("vLLM refuses the engine arguments: " + "; ".join(
            str(err.get("msg", "")).removeprefix("Value error, ") for err in e.errors())) from None
    except (ValueError, TypeError, NotImplementedError) as e:
        raise ServeArgsError(f"vLLM refuses the engine arguments: {' '.join(str(e).split())}") from None


def kv_events_config(port: int, dp_size: int = 1) -> Any:
    """vLLM's ZMQ KV-cache event publisher on ``port`` (DP rank r on port + r); 0: a free port per rank, on this
    node's IP (set VLLM_HOST_IP=127.0.0.1 to keep it local). Dynamo's KV router listens to it (gRPC
    GetKvEventSources tells the sidecar where), and gRPC SubscribeKvEvents relays it (app/grpc/kv_events.py). Its
    replay socket (the last batches, for a subscriber resuming from a sequence number) is on port + dp_size + r
    (free ports with 0)."""
    from vllm.config.kv_events import KVEventsConfig

    replay = f"tcp://*:{port + dp_size}" if port else "tcp://*:0"
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}",
                          replay_endpoint=replay)
