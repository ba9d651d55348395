"""A tiny random-weight Qwen3-MoE that vLLM serves on CPU (router replay's tests: ``--enable-return-routed-experts``).

Written offline and deterministically from a seed, float32, like the dense tiny model (``app.tiny.model``), whose
attention, norms and embeddings it shares; every layer's MLP is a sparse MoE block (8 experts, top 2), with the
per-expert tensor names of Hugging Face's Qwen3-MoE checkpoints. The router's weights are drawn wide so that the
top-k of its logits is far from ties: the ids vLLM routes to and transformers' router top-k are compared exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.tiny.model import DEFAULT_SEED, TINY_CONFIG, tiny_state_dict

MOE_CONFIG: dict[str, Any] = {
    **{k: v for k, v in TINY_CONFIG.items() if k != "intermediate_size"},
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.0,
    "output_router_logits": False,
}


def moe_state_dict(seed: int = DEFAULT_SEED) -> dict[str, Any]:
    """The HF-named float32 tensors of the tiny MoE, drawn from ``seed``."""
    import torch

    cfg = MOE_CONFIG
    sd = {k: v for k, v in tiny_state_dict(seed, {**cfg, "intermediate_size": 1}).items() if ".mlp." not in k}
    gen = torch.Generator().manual_seed(seed + 1)
    h, inter, experts = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp."
        sd[p + "gate.weight"] = rand(experts, h, std=0.5)  # router logits of a few units: no near-ties in the top-k
        for e in range(experts):
            sd[p + f"experts.{e}.gate_proj.weight"] = rand(inter, h, std=0.1)
            sd[p + f"experts.{e}.up_proj.weight"] = rand(inter, h, std=0.1)
            sd[p + f"experts.{e}.down_proj.weight"] = rand(h, inter, std=0.1)
    return sd


def make_tiny_moe(out_dir: str | Path, seed: int = DEFAULT_SEED, force: bool = False) -> Path:
    """Write config.json and model.safetensors of the tiny MoE into ``out_dir`` (no tokenizer: it is served
    tokens-only). An existing complete model is left alone unless ``force``. Returns the directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if not force and (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tmp_weights = out / "model.safetensors.tmp"
    save_file(moe_state_dict(seed), str(tmp_weights), metadata={"format": "pt", "tito_seed": str(seed)})
    tmp_cfg = out / "config.json.tmp"
    tmp_cfg.write_text(json.dumps(MOE_CONFIG, indent=2, sort_keys=True) + "\n")
    tmp_weights.replace(out / "model.safetensors")
    tmp_cfg.replace(out / "config.json")
    return out
