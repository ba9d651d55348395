"""vLLM's own ``/server_info`` keys (``vllm_config``, ``vllm_env``): what a client that reads a vLLM server's
configuration (TRL) finds in tito's ``/server_info`` too."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

_CONFIG_ADAPTER: TypeAdapter[Any] | None = None


def vllm_server_info(llm: AsyncLLM, config_format: str) -> dict[str, Any]:
    """vLLM's own ``/server_info`` keys: ``vllm_config`` (text, or with ``config_format=json`` the JSON tree vLLM
    dumps, which TRL reads) and ``vllm_env``. vLLM's ``system_env`` (a slow environment survey) is left out."""
    import vllm.envs as envs
    from vllm.config import VllmConfig
    from vllm.config.utils import normalize_value

    global _CONFIG_ADAPTER
    cfg = llm.vllm_config
    if config_format == "json":
        if _CONFIG_ADAPTER is None:  # building it walks vLLM's whole config schema: once
            _CONFIG_ADAPTER = TypeAdapter(VllmConfig)
        config: Any = _CONFIG_ADAPTER.dump_python(cfg, mode="json", fallback=str)
    else:
        config = str(cfg)
    env = {}
    for key in dir(envs):
        if key.startswith("VLLM_") and "KEY" not in key:
            value = getattr(envs, key, None)
            if value is not None:
                env[key] = normalize_value(value)
    return {"vllm_config": config, "vllm_env": env}
