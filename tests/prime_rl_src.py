"""Prime-RL's own code from its source snapshot (the commit the tests use; never copied into tito), importable in the
test process.

``../shared/thirdparty/prime-rl`` beside the checkout (``TITO_PRIME_RL_SRC`` elsewhere); a test that needs it is
skipped, saying so, when it is absent. Two stand-ins, each for an import the path the tests run never uses:

- ``prime_rl.trainer.models``'s package ``__init__`` registers every Prime-RL model class and imports torchtitan; the
  writer (``prime_rl.utils.weights``) needs only ``prime_rl.trainer.models.base``, so the package is entered without
  its ``__init__``.
- ``prime_rl.utils.client`` imports ``verifiers.v1`` for its data-plane client configs; the admin calls
  (``setup_admin_clients``, ``update_weights``) never touch them, so an empty ``verifiers`` stands in when the real
  package is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("TITO_PRIME_RL_SRC", Path(__file__).resolve().parents[1].parent / "shared" / "thirdparty"
                           / "prime-rl"))


def use_prime_rl() -> None:
    """Put the snapshot on sys.path (skip the test if it is absent), with the stand-ins above."""
    src = ROOT / "src"
    if not (src / "prime_rl").is_dir():
        pytest.skip(f"Prime-RL's source snapshot is not at {ROOT} (set TITO_PRIME_RL_SRC)")
    for p in (src, ROOT / "packages" / "prime-rl-configs" / "src"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    if "prime_rl.trainer.models" not in sys.modules:
        pkg = types.ModuleType("prime_rl.trainer.models")
        pkg.__path__ = [str(src / "prime_rl" / "trainer" / "models")]
        sys.modules["prime_rl.trainer.models"] = pkg
    if "verifiers" not in sys.modules and importlib.util.find_spec("verifiers") is None:
        names = ["verifiers", "verifiers.v1", "verifiers.v1.configs", "verifiers.v1.configs.client"]
        mods = {n: types.ModuleType(n) for n in names}
        for n in names[:-1]:
            mods[n].__path__ = []
        client = mods["verifiers.v1.configs.client"]
        client.EvalClientConfig = client.TrainClientConfig = type("UnusedOnTheAdminPath", (), {})  # type: ignore
        mods["verifiers.v1"].ClientConfig = client.EvalClientConfig  # type: ignore[attr-defined]
        sys.modules.update(mods)


PRIME_MODEL = "Qwen/Qwen3-0.6B"  # the name Prime-RL's launcher resolves its parsers from (hermes for Qwen3)
PRIME_CONTEXT = 512


def launcher_argv(port: int, model_dir: Path, **vllm: object) -> list[str]:
    """The `vllm serve` command line Prime-RL's launcher builds for a Qwen3 model at its defaults
    (``InferenceConfig.to_namespace()``, written by tito's ``namespace_argv``), with only this machine's values set:
    dtype, context and memory share in Prime-RL's own config, and the model served from ``model_dir`` under the name
    Prime-RL asked for (no model hub here). ``vllm``: more of Prime-RL's ``[inference.vllm]`` settings (e.g.
    ``data_parallel_size=2``, from which its config derives the rest, ``api_server_count`` included)."""
    from app.engine.vllm_args import namespace_argv

    use_prime_rl()
    from prime_rl.configs.inference import InferenceConfig

    machine = {"dtype": "float32", "max_model_len": PRIME_CONTEXT, "gpu_memory_utilization": 0.3}
    config = InferenceConfig(server={"port": port}, vllm={"model": PRIME_MODEL, **machine, **vllm})
    argv = namespace_argv(vars(config.to_namespace()))
    at = argv.index("--model")
    argv[at + 1:at + 2] = [str(model_dir), "--served-model-name", PRIME_MODEL]
    return argv


async def prime_rl_update(url: str, step_dir: Path, step: int) -> None:
    """Prime-RL's orchestrator's call for a full-model step: ``update_weights`` (pause with keep, ``/update_weights``,
    resume) on its admin clients for ``url``."""
    use_prime_rl()
    from prime_rl.configs.shared import ClientConfig
    from prime_rl.utils.client import setup_admin_clients, update_weights

    clients = setup_admin_clients(ClientConfig(base_url=f"{url}/v1"))
    try:
        await update_weights(clients, step_dir, step=step)
    finally:
        for c in clients:
            await c.aclose()
