"""MoE routed experts (``--enable-return-routed-experts``, Prime-RL's router replay): where the engine can capture
them, and their wire form. docs/guides/lora-exactness.md says how to start tito for router replay."""

from __future__ import annotations

from typing import Any

from app.core.settings import Settings


def routed_experts_b64(experts: Any) -> str | None:
    """An output's routed experts (a numpy array, with --enable-return-routed-experts) as vLLM's own token API sends
    them: base64 of the array's ``.npy`` bytes."""
    if experts is None:
        return None
    from vllm.utils.serial_utils import numpy2base64

    return str(numpy2base64(experts))


def routed_experts_compact(experts: Any, start: int = 0) -> dict[str, Any] | None:
    """Prime-RL's form (its server's ``serialize_routed_experts``, what its ``renderers``/``verifiers`` decode):
    ``{"data", "shape", "start", "dtype"}``: the ``[positions, moe_layers, top_k]`` ids as uint8 (uint16 past 255
    experts), C-order raw bytes in base64, ``data`` first (the client splices it out before parsing the JSON);
    ``start``: the request's ``routed_experts_prompt_start``, the position of the first row."""
    if experts is None:
        return None
    import base64

    import numpy as np

    array = np.asarray(experts)
    if array.ndim != 3 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"routed experts must be a 3-D integer array, got {array.dtype} {array.shape}")
    top = int(array.max()) if array.size else 0
    if array.size and (int(array.min()) < 0 or top > np.iinfo(np.uint16).max):
        raise ValueError(f"routed expert ids out of range [0, 65535]: {int(array.min())}..{top}")
    dtype = np.uint8 if top <= np.iinfo(np.uint8).max else np.uint16
    compact = np.ascontiguousarray(array.astype(dtype, copy=False))
    return {"data": base64.b64encode(compact.tobytes()).decode("ascii"), "shape": list(compact.shape),
            "start": int(start), "dtype": np.dtype(dtype).name}


def routed_experts_wire(experts: Any, start: int, form: str) -> Any:
    """``--routed-experts-format``: ``prime-rl`` (``routed_experts_compact``) or ``npy`` (vLLM's own)."""
    return routed_experts_b64(experts) if form == "npy" else routed_experts_compact(experts, start)


def routed_experts_refusal(settings: Settings) -> str:
    """Why this platform cannot serve ``--enable-return-routed-experts`` ("" when it can or the flag is off). On CPU
    it takes tito's fix to vLLM's CPU runner (app/engine/vllm_patches.py), installed here in the process that builds
    the engine configuration."""
    if not settings.enable_return_routed_experts:
        return ""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ""
    from app.engine.vllm_patches import routed_experts_on_cpu

    if not routed_experts_on_cpu():
        return ("--enable-return-routed-experts on the CPU platform needs tito's fix to vLLM's CPU model runner "
                "(vLLM 0.32 captures routed experts only in its GPU Model Runner V2), which is not applied here "
                "(TITO_VLLM_PATCHES=0, or a vLLM version it was not written for). Start without it, or with the fix.")
    if settings.enforce_eager is False:
        return ("--enable-return-routed-experts on the CPU platform needs --enforce-eager (implied when not given): "
                "under torch.compile the CPU runner's capture is lost (measured: every id 0).")
    from app.engine.process_start import fork_refusal

    if why := fork_refusal(settings.engine_start):
        return ("--enable-return-routed-experts on the CPU platform needs the engine's processes forked "
                f"(--engine-start fork, the default), which inherit tito's fix; spawned ({why}), vLLM's engine core "
                "checks the configuration again without it.")
    if settings.data_parallel_size > 1:
        return ("--enable-return-routed-experts on the CPU platform runs with one engine (--data-parallel-size 1): "
                "the capture across data-parallel ranks has not been run on CPU.")
    return ""
