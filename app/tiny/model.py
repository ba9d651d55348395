"""The embedded default model: a tiny random-weight Qwen3 that vLLM serves on CPU.

Written offline, deterministically from a seed (same seed → same bytes), float32, with a byte-level BPE tokenizer
(app/tiny/tokenizer.py) for what sits in front of tito and speaks text (Dynamo's frontend). tito itself still
serves it tokens-only and answers text-mode requests with a clear 400.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULT_SEED = 1234

# head_dim must be one vLLM's CPU attention kernels support (64 works, 16 crashes).
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
}


def tiny_state_dict(seed: int = DEFAULT_SEED, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return the HF-named float32 tensors of the tiny model, drawn from ``seed``."""
    import torch

    cfg = config or TINY_CONFIG
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    def norm(n: int) -> torch.Tensor:
        # Near-one norms with some spread so they matter in the forward pass.
        return 1.0 + rand(n, std=0.1)

    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(vocab, h, std=1.0),
        "model.norm.weight": norm(h),
        "lm_head.weight": rand(vocab, h, std=0.5),
    }
    if cfg.get("tie_word_embeddings"):  # one tensor for both, saved once (as Hugging Face saves a tied model)
        del sd["lm_head.weight"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(h)
        sd[p + "post_attention_layernorm.weight"] = norm(h)
        sd[p + "self_attn.q_proj.weight"] = rand(nh * hd, h, std=0.1)
        sd[p + "self_attn.k_proj.weight"] = rand(nkv * hd, h, std=0.1)
        sd[p + "self_attn.v_proj.weight"] = rand(nkv * hd, h, std=0.1)
        sd[p + "self_attn.o_proj.weight"] = rand(h, nh * hd, std=0.1)
        sd[p + "self_attn.q_norm.weight"] = norm(hd)
        sd[p + "self_attn.k_norm.weight"] = norm(hd)
        sd[p + "mlp.gate_proj.weight"] = rand(inter, h, std=0.1)
        sd[p + "mlp.up_proj.weight"] = rand(inter, h, std=0.1)
        sd[p + "mlp.down_proj.weight"] = rand(h, inter, std=0.1)
    return sd


def make_tiny_model(out_dir: str | Path, seed: int = DEFAULT_SEED, force: bool = False, tokenizer: bool = True,
                    tied: bool = False) -> Path:
    """Write config.json and model.safetensors for the tiny model into ``out_dir`` (and, with ``tokenizer``, the
    tokenizer files and generation_config.json). ``tied``: the head is the embedding (``tie_word_embeddings``, as
    Qwen3-0.6B), and the checkpoint holds no ``lm_head.weight``.

    Returns the directory. An existing complete model is left alone unless ``force`` (a missing tokenizer is added).
    """
    from safetensors.torch import save_file

    from app.tiny.tokenizer import write_tokenizer

    out = Path(out_dir)
    if not force and (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        if tokenizer and not (out / "tokenizer.json").is_file():
            write_tokenizer(out, TINY_CONFIG)
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = {**TINY_CONFIG, "tie_word_embeddings": tied}
    sd = tiny_state_dict(seed, config)
    # Write to temporary names and rename, so an interrupted run never leaves a half model behind.
    tmp_weights = out / "model.safetensors.tmp"
    save_file(sd, str(tmp_weights), metadata={"format": "pt", "tito_seed": str(seed)})
    tmp_cfg = out / "config.json.tmp"
    tmp_cfg.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp_weights.replace(out / "model.safetensors")
    tmp_cfg.replace(out / "config.json")
    if tokenizer:
        write_tokenizer(out, TINY_CONFIG)
    return out
