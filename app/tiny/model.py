"""The embedded default model: a tiny random-weight Qwen3 that vLLM serves on CPU; and random models of the shapes
users train (``SHAPES``: Qwen3-0.6B, 1.7B and 4B's architecture, bf16, tied), for benchmarks and the seed's run.

Written offline, deterministically from a seed (same seed → same bytes), with a byte-level BPE tokenizer
(app/tiny/tokenizer.py) for what sits in front of tito and speaks text (Dynamo's frontend, a trainer's renderer).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
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


# Qwen3's published architectures (hidden, MLP, layers, heads, KV heads, head_dim, vocabulary, context, RoPE base,
# tied head), with bos/eos moved to the small tokenizer's ids: the weights are random, so only the shapes matter (the
# engine's work per token, the checkpoint's bytes per update).
_QWEN3 = {k: v for k, v in TINY_CONFIG.items() if k not in ("bos_token_id", "eos_token_id")}
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": TINY_CONFIG,
    **{name: {**_QWEN3, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "tie_word_embeddings": True,
              "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "head_dim": 128,
              "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": 8}
       for name, (h, inter, layers, heads) in {"qwen3-0.6b": (1024, 3072, 28, 16),
                                              "qwen3-1.7b": (2048, 6144, 28, 16),
                                              "qwen3-4b": (2560, 9728, 36, 32)}.items()},
}
# A shard of a shaped checkpoint holds at most this many bytes (as Hugging Face shards); the writer keeps one shard in
# memory at a time, so the 4B shape (8 GB in bf16) is written without holding the whole model.
SHARD_BYTES = 2 << 30


def tiny_state_dict(seed: int = DEFAULT_SEED, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return the HF-named float32 tensors of the tiny model, drawn from ``seed``."""
    return dict(_tensors(seed, config or TINY_CONFIG))


def _tensors(seed: int, cfg: dict[str, Any], shaped: bool = False) -> Iterator[tuple[str, Any]]:
    """The HF-named float32 tensors of a Qwen3 of config ``cfg``, one at a time, drawn from ``seed`` in checkpoint
    order. ``shaped``: spreads scaled to the layer widths (1/sqrt(fan-in)) so a 28-layer bf16 model keeps finite,
    non-degenerate logits; the tiny model keeps its own wider draws (its tests' references were made from them)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    def norm(n: int) -> torch.Tensor:
        # Near-one norms with some spread so they matter in the forward pass.
        return 1.0 + rand(n, std=0.1)

    def proj(out: int, fan_in: int) -> torch.Tensor:
        return rand(out, fan_in, std=fan_in ** -0.5 if shaped else 0.1)

    yield "model.embed_tokens.weight", rand(vocab, h, std=0.1 if shaped else 1.0)
    yield "model.norm.weight", norm(h)
    tied = cfg.get("tie_word_embeddings")
    if not tied or not shaped:  # the tiny model draws it when tied too: its layers' draws are the same either way
        head = rand(vocab, h, std=0.5)
        if not tied:  # a tied head is the embedding, saved once (as Hugging Face saves a tied model)
            yield "lm_head.weight", head
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm(h)
        yield p + "post_attention_layernorm.weight", norm(h)
        yield p + "self_attn.q_proj.weight", proj(nh * hd, h)
        yield p + "self_attn.k_proj.weight", proj(nkv * hd, h)
        yield p + "self_attn.v_proj.weight", proj(nkv * hd, h)
        yield p + "self_attn.o_proj.weight", proj(h, nh * hd)
        yield p + "self_attn.q_norm.weight", norm(hd)
        yield p + "self_attn.k_norm.weight", norm(hd)
        yield p + "mlp.gate_proj.weight", proj(inter, h)
        yield p + "mlp.up_proj.weight", proj(inter, h)
        yield p + "mlp.down_proj.weight", proj(h, inter)


def make_tiny_model(out_dir: str | Path, seed: int = DEFAULT_SEED, force: bool = False, tokenizer: bool = True,
                    tied: bool = False, shape: str = "tiny") -> Path:
    """Write config.json and the weights of a random model into ``out_dir`` (and, with ``tokenizer``, the tokenizer
    files and generation_config.json). ``shape``: a name of ``SHAPES`` (default the tiny float32 model; the others are
    bf16 and tied, written as Hugging Face shards them). ``tied`` (tiny only): the head is the embedding
    (``tie_word_embeddings``), and the checkpoint holds no ``lm_head.weight``.

    Returns the directory. An existing complete model is left alone unless ``force`` (a missing tokenizer is added).
    """
    from app.tiny.tokenizer import write_tokenizer

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
    out = Path(out_dir)
    config = {**TINY_CONFIG, "tie_word_embeddings": tied} if shape == "tiny" else SHAPES[shape]
    if not force and (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        if tokenizer and not (out / "tokenizer.json").is_file():
            write_tokenizer(out, config)
        return out
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    _write_weights(out, _tensors(seed, config, shaped=shape != "tiny"), config, seed)
    # config.json last, through a temporary name: a directory with a config.json holds a whole model.
    tmp_cfg = out / "config.json.tmp"
    tmp_cfg.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp_cfg.replace(out / "config.json")
    if tokenizer:
        write_tokenizer(out, config)
    return out


def _write_weights(out: Path, tensors: Iterator[tuple[str, Any]], config: dict[str, Any], seed: int) -> None:
    """Save ``tensors`` in ``config``'s dtype: one model.safetensors up to ``SHARD_BYTES``, else shards and an index,
    as Hugging Face writes them; each file through a temporary name, renamed once all are written."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, config["torch_dtype"])
    meta = {"format": "pt", "tito_seed": str(seed)}
    names: list[list[str]] = [[]]
    shard: dict[str, Any] = {}
    size = total = 0
    for name, t in tensors:
        t = t.to(dtype).contiguous()
        if shard and size + t.nbytes > SHARD_BYTES:  # this shard is full: write it, keep one shard in memory
            save_file(shard, str(out / f"shard-{len(names)}.tmp"), metadata=meta)
            shard, size = {}, 0
            names.append([])
        shard[name] = t
        names[-1].append(name)
        size += t.nbytes
        total += t.nbytes
    save_file(shard, str(out / f"shard-{len(names)}.tmp"), metadata=meta)
    if len(names) == 1:
        (out / "shard-1.tmp").replace(out / "model.safetensors")
        return
    weight_map = {}
    for i, shard_names in enumerate(names, 1):
        fname = f"model-{i:05d}-of-{len(names):05d}.safetensors"
        (out / f"shard-{i}.tmp").replace(out / fname)
        weight_map.update(dict.fromkeys(shard_names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
