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


def routed_experts_refusal(settings: Settings) -> str:
    """Why this platform cannot serve ``--enable-return-routed-experts`` ("" when it can or the flag is off)."""
    if not settings.enable_return_routed_experts:
        return ""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ""
    return ("--enable-return-routed-experts is not supported on the CPU platform: vLLM 0.32 captures routed experts "
            "only in its GPU model runner (the CPU runner never fills them, so every answer would carry "
            "routed_experts null). Start without it on CPU; on a GPU machine it is passed to vLLM.")
