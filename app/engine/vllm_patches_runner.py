"""tito's fixes to vLLM's CPU model runner (5, 6 and 7 of app/engine/vllm_patches.py, which describes each and
applies them from ``install()``): routed experts on CPU, MoE weight updates on CPU, and the seeded rewind."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

# Set on each function a fix put in vLLM's place, so that applying the fixes twice wraps nothing twice.
MARK = "_tito_patch"


def patch_cpu_routed_experts() -> bool:
    """vLLM pull request 45635 (and 50721) wired router replay into Model Runner V2 only, which needs Triton, and
    gated ``--enable-return-routed-experts`` on it (the gate tpu-inference issue 3636 reports on TPU). On the CPU
    platform: the V1 runner drives vLLM's own capture (app/engine/vllm_patches.py's docstring, 5)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.config import VllmConfig
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    check = VllmConfig._verify_aux_output_compatibility
    if getattr(check, MARK, False):
        return True

    @functools.wraps(check)
    def verify(self: Any) -> None:
        if not self.aux_output_config.enabled or self.use_v2_model_runner:
            return check(self)
        if self.speculative_config is not None:  # the step output below has no rejected-draft counts
            raise ValueError("--enable-return-routed-experts on the CPU platform does not support speculative "
                             "decoding")
        # vLLM's check lets platforms that bring their own runner through; here the CPU runner's capture is this fix.
        current_platform.is_out_of_tree = lambda: True  # type: ignore[method-assign]
        try:
            return check(self)
        finally:
            del current_platform.is_out_of_tree

    setattr(verify, MARK, True)
    VllmConfig._verify_aux_output_compatibility = verify  # type: ignore[method-assign]

    init_kv, execute, sample = (CPUModelRunner.initialize_kv_cache, CPUModelRunner.execute_model,
                                CPUModelRunner.sample_tokens)

    @functools.wraps(init_kv)
    def initialize_kv_cache(self: Any, kv_cache_config: Any, is_profiling: bool = False, **kw: Any) -> None:
        init_kv(self, kv_cache_config, is_profiling, **kw)
        if is_profiling or not self.vllm_config.aux_output_config.enabled:
            return
        from vllm.distributed.aux_output_connector.worker import get_aux_output_connector

        old = self.__dict__.pop("_tito_aux_output", None)
        if old is not None:
            old.close()
        self._tito_aux_output = get_aux_output_connector(self.get_model(), self.vllm_config, kv_cache_config)
        self._tito_aux_pending = None

    @functools.wraps(execute)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        connector = self.__dict__.get("_tito_aux_output")
        if connector is None:
            return execute(self, scheduler_output, *args, **kwargs)
        # As Model Runner V2: every step's metadata (new requests, block hashes, finished requests) before its forward.
        connector.begin_step(scheduler_output.aux_output_connector_metadata)
        self._tito_aux_pending = None
        out = execute(self, scheduler_output, *args, **kwargs)
        if out is None:  # the forward ran; sample_tokens follows. Its rows, in the batch's order, taken now.
            batch = self.input_batch
            n = batch.num_reqs
            self._tito_aux_pending = connector.prepare_output(_StepBatch(
                req_ids=list(batch.req_ids[:n]),
                query_start_loc_np=self.query_start_loc.np[:n + 1].copy(),
                num_computed_tokens_np=batch.num_computed_tokens_cpu[:n].copy()))
        return out

    @functools.wraps(sample)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = sample(self, *args, **kwargs)
        pending = self.__dict__.get("_tito_aux_pending")
        if pending is None:
            return out
        self._tito_aux_pending = None
        import numpy as np

        index = out.req_id_to_index
        sampled = np.array([len(out.sampled_token_ids[index[r]]) for r in pending.request_ids], dtype=np.int64)
        pending.enqueue_cpu_copy(sampled, np.zeros_like(sampled))  # no speculative decoding: nothing rejected
        out.aux_output_connector_output = pending.process_output()
        return out

    for fn in (initialize_kv_cache, execute_model, sample_tokens):
        setattr(fn, MARK, True)
    CPUModelRunner.initialize_kv_cache = initialize_kv_cache  # type: ignore[method-assign,assignment]
    CPUModelRunner.execute_model = execute_model  # type: ignore[method-assign,assignment]
    CPUModelRunner.sample_tokens = sample_tokens  # type: ignore[method-assign,assignment]
    return True


class _StepBatch:
    """What the aux-output connector's ``prepare_output`` reads of Model Runner V2's input batch, from the V1 one."""

    def __init__(self, req_ids: list[str], query_start_loc_np: Any, num_computed_tokens_np: Any) -> None:
        self.req_ids = req_ids
        self.query_start_loc_np = query_start_loc_np
        self.num_computed_tokens_np = num_computed_tokens_np


# ------------------------------------------------------------------------------------------ 6. CPU MoE updates


def patch_cpu_moe_reload() -> bool:
    """vLLM issues 48312 / 42821: an unquantized MoE layer's weights in the CPU experts' prepacked layout after an
    update (vLLM prepacks them at the first load only); on the CPU platform only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod as Method

    if not getattr(Method.process_weights_after_loading, MARK, False):
        Method.process_weights_after_loading = _prepacking_again(  # type: ignore[method-assign,assignment]
            Method.process_weights_after_loading)
    return True


def _prepacking_again(original: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """``process_weights_after_loading`` that, on a weight update, also runs the CPU experts' own (pad and prepack),
    as the first load does."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    @functools.wraps(original)
    def process_weights_after_loading(self: Any, layer: Any) -> None:
        update = getattr(self, "moe_kernel", None) is not None  # vLLM's own test for "a weight update"
        original(self, layer)
        if update and self.unquantized_backend == UnquantizedMoeBackend.CPU:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    setattr(process_weights_after_loading, MARK, True)
    return process_weights_after_loading


# ------------------------------------------------------------------------------------------ 7. CPU seeded rewind


def patch_cpu_seeded_rewind() -> bool:
    """vLLM pull request 10097's rewind of a discarded sample, made for CPU generators; on the CPU platform only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as Runner

    if not getattr(Runner._sample, MARK, False):
        Runner._sample = _restoring_discarded(Runner._sample)  # type: ignore[method-assign]
        Runner._bookkeeping_sync = _without_discarded(Runner._bookkeeping_sync)  # type: ignore[method-assign]
    return True


def _discarded_generators(runner: Any) -> dict[int, Any]:
    """The seeded generators of the rows whose sample this step throws away (a chunk of a longer prefill)."""
    n = runner.input_batch.num_reqs
    gens = runner.input_batch.generators
    return {i: gens[i] for i in map(int, runner.discard_request_mask.np[:n].nonzero()[0]) if i in gens}


def _restoring_discarded(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_sample`` that puts each discarded row's generator back where it was before sampling: a CPU generator
    (mt19937) has no offset to step back, but its whole state can be saved and restored, which is exact."""

    @functools.wraps(original)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = {i: g.get_state() for i, g in _discarded_generators(self).items()}
        out = original(self, *args, **kwargs)
        for i, state in saved.items():
            self.input_batch.generators[i].set_state(state)
        return out

    setattr(_sample, MARK, True)
    return _sample


def _without_discarded(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_bookkeeping_sync`` with the discarded rows' generators out of its sight: their rewind is done, and its own
    (``set_offset``) raises on a CPU generator."""

    @functools.wraps(original)
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        gens = self.input_batch.generators
        skip = _discarded_generators(self)
        if not skip:
            return original(self, *args, **kwargs)
        self.input_batch.generators = {i: g for i, g in gens.items() if i not in skip}
        try:
            return original(self, *args, **kwargs)
        finally:
            self.input_batch.generators = gens

    setattr(_bookkeeping_sync, MARK, True)
    return _bookkeeping_sync
