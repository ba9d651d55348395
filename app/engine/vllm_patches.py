"""tito's fixes to vLLM 0.32, applied inside the engine's worker processes (from ``app/engine/worker.py``), and, when
the engine's processes are forked (CPU, ``app/engine/process_start.py``), in the server process before it forks them, so
the engine core has them too.

Each fix names the upstream vLLM issue or pull request it stands in for and is applied only on the vLLM versions it
was written against (``SUPPORTED``): on another version nothing is patched and a warning says so, since the code
being wrapped may have changed. ``TITO_VLLM_PATCHES=0`` in the server's environment leaves vLLM as it is (to show that
the tests in tests/test_lora_exactness.py, tests/test_router_replay.py and tests/test_seeded_cpu.py fail without
the fixes). docs/guides/lora-exactness.md describes them. Fixes 5-7, to the CPU model runner, are written in
``app/engine/vllm_patches_runner.py``, fix 8, to the weight loader, in ``app/engine/vllm_patches_weights.py``;
``install()`` here applies all of them.

1. Prompt logprobs under LoRA (vLLM issues 16668 and 17766; 51594 for an ``lm_head`` adapter): vLLM computes a
   request's prompt logits with the LoRA LM head (``LogitsProcessorWithLoRA``) under the step's *sampler* mapping,
   one adapter index per sampled row, while the rows are the request's prompt tokens. On CPU the shapes clash (or,
   when the counts happen to match, the wrong adapters are applied); on GPU the Triton kernels take the mapping
   unchecked. The fix: while vLLM computes the prompt logits of a request, the sampler mapping is the per-token one
   vLLM already built for the forward pass (``token_lora_indices``), restricted to that request's rows. Both model
   runners: V1 (``_get_prompt_logprobs_dict``; CPU, and GPU without Triton) and V2 (``PromptLogprobsWorker``, the GPU
   default). The GPU side is written from reading vLLM's code and has not been run on a GPU.
2. "No adapter" rows on CPU (vLLM pull request 48421): the PyTorch LoRA ops of the CPU platform gather the adapter
   weights with the index ``-1`` of a base-model row, which selects the *last* adapter slot. Once every slot holds an
   adapter, base requests sharing a step with adapter requests get that adapter. The fix leaves ``-1`` rows untouched,
   as the Triton kernels do (they return early on ``-1``).
3. The worker's busy wait on CPU (vLLM pull requests 51950 and 52814, which make it configurable as
   ``VLLM_SHM_BROADCAST_BUSY_LOOP_S``): a reader of vLLM's shared-memory queue spins (``sched_yield``) for a hard-coded
   second after every message before it sleeps on its notify socket. On a GPU server that is a spare core traded for
   latency; on the CPU platform the worker spins on the very cores the engine core, the API server and the model's
   threads share: after every burst of requests it burns a whole core for a second (10 short requests 2 s apart: 10.6
   CPU-s in the worker against 0.6 in the two other processes). On CPU the window is ``CPU_SPIN_S`` (longer than the
   gap between two steps of a running batch, so decoding never sleeps), or that variable's value when it is set.
4. AMX on CPU (no upstream report found): a process must ask Linux for the AMX tile state (``arch_prctl``
   ``ARCH_REQ_XCOMP_PERM``) before its first tile instruction. vLLM's CPU attention picks its AMX kernel for bfloat16
   when ``torch.cpu._is_amx_tile_supported()`` (the CPU's flags only) and never asks, so on an AMX Xeon the worker
   dies of SIGILL at its first forward in bfloat16. The fix asks once per process (PyTorch's ``_init_amx``); the
   permission is inherited by forked children.
5. Routed experts on CPU (vLLM pull request 45635, which gated ``--enable-return-routed-experts`` on Model Runner V2,
   and 50721, V2's capture; tpu-inference issue 3636 reports the same gate on TPU): V2 needs Triton, so on the CPU
   platform vLLM refuses the flag. Its capture itself runs anywhere: the CPU router is a ``BaseRouter``, which hands
   each MoE layer's top-k ids to a bound capture function. What the CPU (V1) runner lacks is the worker half of
   vLLM's aux-output connector, which the fix adds as V2 has it: bind the capturer once the KV cache is known, open
   each step with the scheduler's metadata, snapshot the step's rows after the forward, and hand them back with the
   step's output. The scheduler's connector, the block store and ``CompletionOutput.routed_experts`` are vLLM's,
   unchanged; so is the config check, past its V2 gate. Eager only: under torch.compile the rows captured were all 0
   (tito refuses that pairing, app/engine/routed_experts.py); no speculative decoding (the step output carries no
   rejected-draft counts here). Installed in the process that builds the engine configuration and, by fork, in the
   engine core, which checks the configuration again (spawned, it would not have the fix: tito refuses that too).
6. MoE weight updates on CPU (vLLM's reload-correctness tracker, issue 48312; issue 42821 is the same bug on
   FlashInfer's layouts): the CPU experts prepack their weights into the grouped-GEMM layout once, at the first
   load; a weight update copies the new checkpoint-layout weights into that storage and never prepacks them again, so
   every MoE layer computes with garbage after the first update (measured on the tiny MoE: the first MoE layer's
   routing, which reads no expert weights, followed the update; the second's and the tokens did not). The fix
   prepacks again after each update, as the first load does.
7. Seeded sampling with chunked prefill on CPU (vLLM pull request 10097 wrote the rewind for CUDA's Philox
   generators; vllm-rbln pull request 1025 and vllm-qaic pull request 92 met it in their CPU-generator runners): a
   step that computes only part of a request (a chunk of a long prompt, or of a preempted request's recompute) still
   samples a token for it, throws it away, and steps the request's generator back with ``set_offset``, which a CPU
   generator (mt19937) refuses: the EngineCore dies at the first seeded request longer than a step. The fix saves
   each such generator's state before sampling and restores it after, so the request draws exactly as if the chunk
   had not sampled; vLLM's own rewind then skips those rows. This is what lets tito run vLLM's CPU default, chunked
   prefill on.
8. A tied LM head on CPU after a weight update (vLLM's reload-correctness tracker, issue 48312; pull request 52147
   standardised tying on ``ParallelLMHead.tie_weights``, which on CPU does not carry the processed kernel): both halves
   of a tied pair are processed after loading, so the embedding's weight is packed for oneDNN's GEMM twice (once for
   the embedding, whose forward is a lookup and never uses it, once for the head). A reload re-processes the
   embedding and leaves the head, which loads nothing, on the GEMM handle packed from the old weights: vLLM's own
   server keeps serving the old head after ``reload_weights``. The fix: after the first load's processing and after
   every layerwise reload, the head takes the embedding's processed kernel (the same weight, packed once, from the
   new values). An update then costs no re-pack of the head, and the model holds one packed copy of the matrix
   instead of two (311 MB less at Qwen3-0.6B's shape, 778 MB at 4B's).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from app.engine.vllm_patches_runner import MARK as _MARK
from app.engine.vllm_patches_runner import patch_cpu_moe_reload, patch_cpu_routed_experts, patch_cpu_seeded_rewind
from app.engine.vllm_patches_weights import patch_cpu_tied_head

log = logging.getLogger("tito.vllm_patches")

SUPPORTED = ("0.32.",)
ENV = "TITO_VLLM_PATCHES"

_applied: list[str] = []


def install() -> list[str]:
    """Apply every fix once per process; returns the names of those applied (``[]`` when disabled or unsupported)."""
    if _applied:
        return list(_applied)
    import vllm

    if os.environ.get(ENV, "1") == "0":
        log.warning("%s=0: tito's fixes to vLLM (LoRA prompt logprobs, CPU no-adapter rows, CPU busy wait, AMX "
                    "permission, routed experts on CPU, CPU MoE weight updates, CPU seeded rewind, CPU tied head) "
                    "are NOT applied", ENV)
        return []
    if not vllm.__version__.startswith(SUPPORTED):
        log.warning("vLLM %s is not one tito's vLLM fixes were written for (%s): none applied; LoRA prompt logprobs "
                    "and CPU base rows may be wrong", vllm.__version__, ", ".join(SUPPORTED))
        return []
    _patch_prompt_logprobs()
    _applied.append("prompt-logprobs-per-token-lora (vLLM #16668, #17766, #51594)")
    _patch_cpu_no_lora_rows()
    _applied.append("cpu-lora-no-adapter-rows (vLLM #48421)")
    if _patch_cpu_busy_wait():
        _applied.append(f"cpu-worker-busy-wait-{spin_window_s()}s (vLLM #51950, #52814)")
    if request_amx_permission():
        _applied.append("cpu-amx-permission")
    if patch_cpu_routed_experts():
        _applied.append("cpu-routed-experts (vLLM #45635, tpu-inference #3636)")
    if patch_cpu_moe_reload():
        _applied.append("cpu-moe-weight-update (vLLM #48312, #42821)")
    if patch_cpu_seeded_rewind():
        _applied.append("cpu-seeded-rewind (vLLM #10097)")
    if patch_cpu_tied_head():
        _applied.append("cpu-tied-head-kernel (vLLM #48312)")
    log.info("vLLM %s with tito's fixes: %s", vllm.__version__, "; ".join(_applied))
    return list(_applied)


# ------------------------------------------------------------------------------------------ 1. prompt logprobs


def _patch_prompt_logprobs() -> None:
    """vLLM issues 16668 and 17766 (and 51594 for an ``lm_head`` adapter): prompt logits under the sampler mapping."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU runner inherits this method

    original = GPUModelRunner._get_prompt_logprobs_dict
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def _get_prompt_logprobs_dict(self: Any, hidden_states: Any, num_scheduled_tokens: dict[str, int]) -> Any:
        punica = _lm_head_punica(self.get_model()) if self.num_prompt_logprobs and self.lora_config else None
        if punica is None:  # no LoRA LM head: the prompt logits do not depend on the LoRA mapping
            return original(self, hidden_states, num_scheduled_tokens)
        model = self.model
        # vLLM calls ``self.model.compute_logits(hidden_states[offset : offset + n])`` once per request.
        model.compute_logits = _per_token(model.compute_logits, hidden_states, punica)  # this call only
        try:
            return original(self, hidden_states, num_scheduled_tokens)
        finally:
            del model.compute_logits

    setattr(_get_prompt_logprobs_dict, _MARK, True)
    GPUModelRunner._get_prompt_logprobs_dict = _get_prompt_logprobs_dict  # type: ignore[method-assign]
    _patch_model_runner_v2()


def _patch_model_runner_v2() -> None:
    """The same fix in vLLM's Model Runner V2 (the default on GPU machines with Triton), which hands its prompt
    logprobs worker ``model.compute_logits`` and slices of the step's hidden states (chunks of every row, or one
    request's rows). Not importable on CPU builds without Triton: then there is nothing to patch."""
    try:
        from vllm.v1.worker.gpu.sample.prompt_logprob import PromptLogprobsWorker
    except Exception:  # noqa: BLE001 - any import failure means this runner cannot run here either
        return
    for name in ("compute_prompt_logprobs", "compute_prompt_token_id_logprobs"):
        original = getattr(PromptLogprobsWorker, name, None)
        if original is None or getattr(original, _MARK, False):
            continue

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def patched(self: Any, logits_fn: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
                model = getattr(logits_fn, "__self__", None)
                punica = _lm_head_punica(model) if model is not None else None
                if punica is not None:
                    logits_fn = _per_token(logits_fn, hidden_states, punica)
                return original(self, logits_fn, hidden_states, *args, **kwargs)

            setattr(patched, _MARK, True)
            return patched

        setattr(PromptLogprobsWorker, name, make(original))


def _per_token(compute: Callable[[Any], Any], hidden_states: Any, punica: Any) -> Callable[[Any], Any]:
    """``compute`` (the model's ``compute_logits``) run on a row slice of ``hidden_states`` with those rows' own
    adapter indices: the per-token mapping vLLM built for the forward pass."""

    def compute_logits(rows: Any) -> Any:
        row = row_of(rows, hidden_states)
        with _sampler_mapping(punica, punica.token_lora_indices[row:row + rows.shape[0]]):
            return compute(rows)

    return compute_logits


def _lm_head_punica(model: Any) -> Any:
    """The punica wrapper of the model's LoRA LM head, or None (the LM head not wrapped for LoRA)."""
    import torch
    from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA

    if not isinstance(model, torch.nn.Module) and hasattr(model, "unwrap"):  # a CUDA graph wrapper (GPU)
        model = model.unwrap()
    if not isinstance(model, torch.nn.Module):
        return None
    cached = getattr(model, "_tito_lm_head_punica", None)
    if cached is not None:
        return cached[0]
    punica = next((m.punica_wrapper for m in model.modules() if isinstance(m, LogitsProcessorWithLoRA)), None)
    model.__dict__["_tito_lm_head_punica"] = (punica,)  # a plain attribute, beside the module's own
    return punica


def row_of(view: Any, base: Any) -> int:
    """The first row of ``base`` that ``view`` (a row slice of it) starts at. Fails loudly on anything else, so a
    change in vLLM's code cannot turn into silently misapplied adapters."""
    same = view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() and view.stride() == base.stride()
    row, rest = divmod(view.storage_offset() - base.storage_offset(), base.stride(0)) if same else (-1, 1)
    if rest or row < 0 or row + view.shape[0] > base.shape[0]:
        raise RuntimeError("tito's LoRA prompt-logprobs fix: the prompt rows are not a slice of the step's hidden "
                           "states (vLLM's _get_prompt_logprobs_dict changed?)")
    return int(row)


@contextlib.contextmanager
def _sampler_mapping(punica: Any, indices: Any) -> Iterator[None]:
    """``punica.sampler_indices`` (what the LoRA LM head reads) is ``indices`` inside the block, then as before. The
    GPU wrapper reads the same mapping through ``prompt_mapping_meta``, prepared from it as vLLM does per step."""
    saved_len = punica.indices_len[1]
    saved = punica._sampler_indices[:saved_len].clone()
    meta = getattr(punica, "prompt_mapping_meta", None)

    def set_mapping(values: Any) -> None:
        punica._sampler_indices[:values.shape[0]].copy_(values)
        punica.indices_len[1] = int(values.shape[0])
        if meta is not None:
            with _sync_allowed():
                meta.prepare_tensors(punica.sampler_indices)

    set_mapping(indices.clone())
    try:
        yield
    finally:
        set_mapping(saved)


def _sync_allowed() -> contextlib.AbstractContextManager[Any]:
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ImportError:  # pragma: no cover - the helper moved; the GPU wrapper itself would fail to import
        return contextlib.nullcontext()
    return gpu_sync_allowed()


# ------------------------------------------------------------------------------------------ 2. CPU "no adapter" rows


def _patch_cpu_no_lora_rows() -> None:
    """vLLM pull request 48421: the CPU LoRA ops read index -1 (no adapter) as the last slot."""
    import vllm.lora.ops.torch_ops as package
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        original = getattr(lora_ops, name)
        if getattr(original, _MARK, False):
            continue
        fixed = _skipping_no_lora_rows(original)
        # lora_ops' own sgmv_* ops call these through the module; the CPU wrapper and the package imported them.
        for module in (lora_ops, package, punica_cpu):
            if getattr(module, name, None) is original:
                setattr(module, name, fixed)


def _skipping_no_lora_rows(op: Callable[..., None]) -> Callable[..., None]:
    """``op(inputs, weights, output, indices, ...)`` writing into ``output``, leaving the rows whose index is -1 as
    they were (the Triton kernels' early exit)."""

    @functools.wraps(op)
    def fixed(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any) -> None:
        none = indices < 0
        if not bool(none.any()):
            op(inputs, weights, output, indices, *args, **kwargs)
            return
        import torch

        rows = output.shape[0]
        if none.shape[0] == 1:  # one index broadcast over every row
            mask = none.expand(rows)
        else:
            mask = torch.zeros(rows, dtype=torch.bool, device=output.device)
            k = min(rows, none.shape[0])
            mask[:k] = none[:k]
        kept = output[mask].clone()
        op(inputs, weights, output, indices, *args, **kwargs)
        output[mask] = kept

    setattr(fixed, _MARK, True)
    return fixed


# ------------------------------------------------------------------------------------------ 3. CPU busy wait

# Seconds a reader of the shared-memory queue spins after a message before it sleeps (vLLM: 1): well above the gap
# between two engine steps of a running batch on CPU (well under a millisecond to a few), far below a second.
CPU_SPIN_S = 0.01
SPIN_ENV = "VLLM_SHM_BROADCAST_BUSY_LOOP_S"


def spin_window_s() -> float:
    """The busy-wait window: ``VLLM_SHM_BROADCAST_BUSY_LOOP_S`` when set (the name upstream's fix reads), else
    ``CPU_SPIN_S``."""
    value = os.environ.get(SPIN_ENV)
    return CPU_SPIN_S if value is None or value.strip() == "" else float(value)


def _patch_cpu_busy_wait() -> bool:
    """vLLM pull requests 51950 / 52814: the shared-memory queue's readers spin a hard-coded second; on the CPU
    platform only. Applied before the worker creates its queues (this module loads with the worker extension)."""
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    cls = shm_broadcast.SpinCondition
    original = cls.__init__
    if getattr(original, _MARK, False):
        return True
    window = spin_window_s()

    @functools.wraps(original)
    def __init__(self: Any, is_reader: bool, context: Any, notify_address: str, busy_loop_s: float = 1) -> None:
        original(self, is_reader, context, notify_address, busy_loop_s=min(busy_loop_s, window))

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__  # type: ignore[method-assign]
    return True


# ------------------------------------------------------------------------------------------ 4. AMX permission


def request_amx_permission() -> bool:
    """On the CPU platform, ask Linux for the AMX tile state when the CPU has AMX (vLLM's AMX attention kernel
    assumes it was asked)."""
    import torch
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu() and torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


# ------------------------------------------------------------------------------------------ 5. routed experts on CPU


def routed_experts_on_cpu() -> bool:
    """Whether this process lets vLLM capture routed experts on the CPU platform (``--enable-return-routed-experts``):
    fix 5 (app/engine/vllm_patches_runner.py) is applied. The config half must be in place where the engine
    configuration is built (the API process), before ``create_engine_config``: app/engine/engine_setup.py installs it
    there for the flag."""
    return any(name.startswith("cpu-routed-experts") for name in install())
