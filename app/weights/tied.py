"""A tied LM head (``tie_word_embeddings``, as Qwen3-0.6B): the model has one tensor for the embedding and the head.

A tied model's state dict names that tensor twice, so a trainer's checkpoint (Prime-RL's writer, the NCCL broadcast)
holds ``lm_head.weight`` beside ``model.embed_tokens.weight``, while the served checkpoint (as Hugging Face saves a
tied model) holds the embedding alone. vLLM's own loader skips the head's duplicate (``skip_prefixes=["lm_head."]``
when the config ties them). tito does the same, after checking the duplicate equals the embedding: a head that
differs would be silently dropped by vLLM, so it is refused, naming the tensor. Nothing reaches the model before the
check has passed; the skipped names are in the update's answer.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from app.weights.updates import Checkpoint, TensorInfo, Validation, bad, validate

HEAD_SUFFIX = "lm_head.weight"
EMBEDDING_SUFFIXES = ("embed_tokens.weight", ".wte.weight", "embed_in.weight")
_CHUNK = 16 * 1024 * 1024


def _ties(config: dict[str, Any]) -> bool | None:
    for cfg in (config, config.get("text_config") or {}):
        if isinstance(cfg, dict) and "tie_word_embeddings" in cfg:
            return bool(cfg["tie_word_embeddings"])
    return None


def tied_embedding(model_dir: str | Path, expected: dict[str, TensorInfo]) -> str | None:
    """The embedding the served model's head is tied to, or None (an untied model).

    Tied when its config says so, or (no such key) when its own checkpoint has no head, as Hugging Face saves a tied
    model. The embedding is the one tensor of the model named like one."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    tied = _ties(config) if isinstance(config, dict) else None
    if tied is None:
        tied = not any(n.endswith(HEAD_SUFFIX) for n in expected)
    if not tied:
        return None
    embeddings = [n for n in expected if n.endswith(EMBEDDING_SUFFIXES)]
    return embeddings[0] if len(embeddings) == 1 else None


def tied_heads(names: list[str] | dict[str, Any], expected: dict[str, Any], embedding: str | None) -> list[str]:
    """The names among ``names`` that are the tied head's duplicate (a head the served model does not hold)."""
    if embedding is None:
        return []
    return [n for n in names if n.endswith(HEAD_SUFFIX) and n not in expected]


def _span(path: Path, name: str) -> tuple[int, int, str]:
    """(absolute offset, length, dtype) of tensor ``name``'s bytes in a safetensors file already checked whole."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))[name]
    begin, end = (int(x) for x in meta["data_offsets"])
    return 8 + n + begin, end - begin, str(meta["dtype"])


def _bytes_equal(a: tuple[Path, int, int], b: tuple[Path, int, int]) -> bool:
    (pa, oa, na), (pb, ob, nb) = a, b
    if na != nb:
        return False
    with open(pa, "rb") as fa, open(pb, "rb") as fb:
        fa.seek(oa)
        fb.seek(ob)
        left = na
        while left > 0:
            step = min(_CHUNK, left)
            if fa.read(step) != fb.read(step):
                return False
            left -= step
    return True


def _values_equal(a: tuple[Path, str], b: tuple[Path, str]) -> bool:
    """Equal values across dtypes (a bfloat16 head beside a float32 embedding, say)."""
    import torch
    from safetensors import safe_open

    def load(p: Path, name: str) -> Any:
        with safe_open(str(p), framework="pt") as f:
            return f.get_tensor(name).to(torch.float64)

    return bool(torch.equal(load(*a), load(*b)))


def check_checkpoint(ck: Checkpoint, expected: dict[str, TensorInfo], model_dir: str | Path,
                     dtypes: bool = True) -> Validation:
    """``validate`` with a tied head's duplicate checked equal to the embedding and skipped. Blocking (reads the two
    tensors' bytes when there is a duplicate): run in a thread."""
    embedding = tied_embedding(model_dir, expected)
    heads = tied_heads(ck.tensors, expected, embedding)
    for head in heads:
        assert embedding is not None
        emb = ck.tensors.get(embedding)
        if emb is None:
            raise bad(f"checkpoint has {head!r} but not {embedding!r}: the model ties its head to the embedding "
                      f"(tie_word_embeddings), so the embedding is the tensor it loads.")
        h = ck.tensors[head]
        if h.shape != emb.shape:
            raise bad(f"shape mismatch for {head!r}: checkpoint has {list(h.shape)}, the model ties it to "
                      f"{embedding!r} of shape {list(emb.shape)}.")
        hp, ep = ck.directory / h.file, ck.directory / emb.file
        ho, hn, _ = _span(hp, head)
        eo, en, _ = _span(ep, embedding)
        same = _bytes_equal((hp, ho, hn), (ep, eo, en)) if h.dtype == emb.dtype else \
            _values_equal((hp, head), (ep, embedding))
        if not same:
            raise bad(f"{head!r} differs from {embedding!r}: the model ties its head to the embedding "
                      f"(tie_word_embeddings), so a checkpoint may hold the head only as a copy of the embedding.")
    found = {k: v.shape for k, v in ck.tensors.items()}
    return validate(found, {k: v.dtype for k, v in ck.tensors.items()} if dtypes else None, expected, tied=heads)
