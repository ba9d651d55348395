"""tito's own encoder of Prime-RL's sparse delta (``sparse_delta_v2``), for tests and the bench: the delta between two
state dicts, in either container and either index encoding. Written from the format's description
(/work/shared/spec/staged-delta-updates.md), independently of the decoder in app/delta_format.py, so each checks the
other.

Per tensor: the flat indices where the target differs bitwise from the base, and ``target - base`` in the tensor's
dtype; where adding that back in the dtype does not give the target bits, the whole tensor's values are widened
(float32 for 16-bit floats, float64 for float32). A tied ``lm_head`` equal to ``embed_tokens`` is skipped.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

MAGIC = b"PDELSTRM"
CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4, torch.int64: 5, torch.int32: 6,
         torch.int8: 7, torch.uint8: 8}
WIDER = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64}


def varint_gaps(indices: torch.Tensor) -> bytes:
    """Unsigned LEB128 of the gaps between sorted indices, the first from 0 (byte k of every gap at once)."""
    import numpy as np

    idx = indices.to(torch.int64).numpy()
    gaps = np.diff(idx, prepend=0).astype(np.uint64)
    nbytes = np.ones(gaps.size, dtype=np.int64)
    for k in range(1, 10):
        nbytes += gaps >= (np.uint64(1) << np.uint64(7 * k))
    out = np.zeros(int(nbytes.sum()), dtype=np.uint8)
    start = np.cumsum(nbytes) - nbytes
    for k in range(int(nbytes.max(initial=0))):
        m = nbytes > k
        byte = (gaps[m] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (nbytes[m] - 1 > k).astype(np.uint64) << np.uint64(7)
        out[start[m] + k] = (byte | more).astype(np.uint8)
    return out.tobytes()


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1).contiguous()
    if flat.dtype.is_floating_point:
        return flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    return flat


def tensor_delta(base: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted changed flat indices, values to add) for one tensor."""
    b, t = base.reshape(-1), target.reshape(-1)
    idx = torch.nonzero(_bits(base) != _bits(target)).reshape(-1)
    vals = t[idx] - b[idx]
    if b.dtype.is_floating_point and not torch.equal(_bits(b[idx] + vals), _bits(t[idx])):
        wide = WIDER.get(b.dtype, b.dtype)
        vals = t[idx].to(wide) - b[idx].to(wide)
    return idx, vals


def changed(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor,
                                                                                                torch.Tensor]]:
    out = {}
    for name in sorted(target):
        if name == "lm_head.weight" and "model.embed_tokens.weight" in target and \
                torch.equal(target[name], target["model.embed_tokens.weight"]):
            continue
        idx, vals = tensor_delta(base[name], target[name])
        if idx.numel():
            out[name] = (idx, vals)
    return out


def _encode_idx(idx: torch.Tensor, encoding: str) -> tuple[int, bytes]:
    if encoding == "optimized":
        return 0, varint_gaps(idx)
    if idx.numel() and int(idx.max()) >= 2**31:
        return 2, idx.to(torch.int64).numpy().tobytes()
    return 1, idx.to(torch.int32).numpy().tobytes()


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def stream_order(name: str) -> tuple[int, int, str]:
    """Prime's trainer's order: non-layer tensors first, then layer by layer."""
    parts = name.split(".")
    if "layers" in parts and parts[parts.index("layers") + 1].isdigit():
        return (1, int(parts[parts.index("layers") + 1]), name)
    return (0, 0, name)


class StreamWriter:
    """``delta.stream`` written one tensor at a time (the caller keeps ``stream_order``): a delta of a large model
    without holding two copies of it."""

    def __init__(self, path: Path, encoding: str = "optimized") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.encoding = encoding
        self.f.write(struct.pack("<8sI", MAGIC, 2))

    def add(self, name: str, shape: list[int], idx: torch.Tensor, vals: torch.Tensor) -> None:
        fmt, raw = _encode_idx(idx, self.encoding)
        self.f.write(struct.pack("<IBBHQQ", len(name.encode()), fmt, CODES[vals.dtype], len(shape), len(raw),
                                 vals.numel()))
        self.f.write(name.encode())
        self.f.write(struct.pack(f"<{len(shape)}Q", *shape))
        self.f.write(raw)
        self.f.write(_raw(vals))

    def close(self) -> None:
        self.f.close()


def write_stream(path: Path, base: dict[str, torch.Tensor], target: dict[str, torch.Tensor],
                 encoding: str = "optimized") -> Path:
    """``delta.stream``: non-layer tensors first, then layer by layer (as Prime's trainer writes it)."""
    deltas = changed(base, target)
    w = StreamWriter(path, encoding)
    try:
        for name in sorted(deltas, key=stream_order):
            w.add(name, list(target[name].shape), *deltas[name])
    finally:
        w.close()
    return path


def write_safetensors(path: Path, base: dict[str, torch.Tensor], target: dict[str, torch.Tensor],
                      encoding: str = "optimized") -> Path:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, (idx, vals) in changed(base, target).items():
        fmt, raw = _encode_idx(idx, encoding)
        dtype = {0: torch.uint8, 1: torch.int32, 2: torch.int64}[fmt]
        tensors[name + ".__idx"] = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.zeros(0, dtype=dtype)
        tensors[name + ".__val"] = vals.contiguous()
    meta = {"prime_rl_delta_format": "sparse_delta_v2", "prime_rl_delta_layout": "huggingface",
            "prime_rl_delta_shapes": json.dumps({k: list(v.shape) for k, v in target.items()})}
    save_file(tensors, str(path), metadata=meta)
    return path


def write_delta(path: Path, base: dict[str, torch.Tensor], target: dict[str, torch.Tensor],
                encoding: str = "optimized") -> Path:
    """By the file's name: ``*.stream`` -> stream container, else safetensors."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = write_stream if path.name.endswith(".stream") else write_safetensors
    return writer(path, base, target, encoding)


def perturb(sd: dict[str, torch.Tensor], fraction: float, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A target: a copy of ``sd`` with ``fraction`` of every tensor's elements moved (scattered, like an optimizer step
    on bf16 weights), some by amounts small enough that the values must be widened."""
    gen = torch.Generator().manual_seed(seed)
    return {name: perturb_tensor(sd[name], fraction, gen, scale) for name in sorted(sd)}


def perturb_tensor(t: torch.Tensor, fraction: float, gen: torch.Generator, scale: float = 0.05) -> torch.Tensor:
    """One tensor of ``perturb``'s target."""
    t = t.clone()
    flat = t.reshape(-1)
    mask = torch.rand(flat.numel(), generator=gen) < fraction
    step = torch.randn(int(mask.sum()), generator=gen) * scale
    flat[mask] = (flat[mask].float() + step).to(t.dtype)
    return t


BAD_DELTAS = {  # (base change, target change) that make a delta the model cannot take
    "unknown tensor": ({"model.layers.9.mlp.up_proj.weight": torch.ones(4)},
                       {"model.layers.9.mlp.up_proj.weight": torch.zeros(4)}),
    "shape": ({"model.norm.weight": torch.ones(64)}, {"model.norm.weight": torch.full((64,), 2.0)}),
    "int values on a float tensor": ({"model.norm.weight": torch.ones(128, dtype=torch.int64)},
                                     {"model.norm.weight": torch.full((128,), 2, dtype=torch.int64)}),
}

