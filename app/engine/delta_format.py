"""Prime-RL's sparse weight delta (``sparse_delta_v2``): reading and checking it, and tito's prepared form of it.

A delta says, per tensor (Hugging Face name, logical shape), at which flat indices the target differs from the base
and what to **add** there (``target - base`` in the tensor's dtype, or widened where adding back in that dtype would
not reproduce the target bits). Two containers (``/work/shared/spec/staged-delta-updates.md``):

- ``delta.safetensors``: ``NAME.__idx`` / ``NAME.__val`` (1-D) per tensor; metadata ``prime_rl_delta_format``,
  ``prime_rl_delta_layout`` (``huggingface``) and ``prime_rl_delta_shapes`` (JSON name -> shape). No tensors is valid.
- ``delta.stream``: ``b"PDELSTRM"`` + uint32 version 2, then records: ``<IBBHQQ`` (name length, index format, value
  dtype code, ndim, index bytes, value count), the UTF-8 name, ndim x uint64 shape, index bytes, value bytes.

Index formats: unsigned LEB128 varint of the gaps between sorted indices (first gap from 0), or raw int32/int64.

Everything here reads a record at a time (bounded memory) and raises ``DeltaFormatError`` naming the tensor. The
server (app/weights/staging.py) decodes and checks an upload once, off the event loop, and writes tito's *prepared*
form: the same stream container with raw int64 indices, sorted and unique, which the workers apply
(app/engine/worker_delta.py). Importable in vLLM's worker processes (torch, numpy, safetensors only).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

FORMAT_KEY, FORMAT = "prime_rl_delta_format", "sparse_delta_v2"
LAYOUT_KEY, LAYOUT = "prime_rl_delta_layout", "huggingface"
SHAPES_KEY = "prime_rl_delta_shapes"
IDX_SUFFIX, VAL_SUFFIX = ".__idx", ".__val"
STREAM_NAME, SAFETENSORS_NAME = "delta.stream", "delta.safetensors"

MAGIC, STREAM_VERSION = b"PDELSTRM", 2
HEADER = struct.Struct("<8sI")
RECORD = struct.Struct("<IBBHQQ")
IDX_VARINT, IDX_INT32, IDX_INT64 = 0, 1, 2
CODE_DTYPES: dict[int, torch.dtype] = {1: torch.float16, 2: torch.bfloat16, 3: torch.float32, 4: torch.float64,
                                       5: torch.int64, 6: torch.int32, 7: torch.int8, 8: torch.uint8}
DTYPE_CODES = {d: c for c, d in CODE_DTYPES.items()}
# safetensors dtype tags of the tensors a delta may change, by kind (the base tensor's tag -> what values may be).
FLOAT_TAGS = frozenset({"F16", "BF16", "F32", "F64"})
INT_TAGS = frozenset({"I8", "U8", "I16", "I32", "I64"})
TAG_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
              "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}

# Sanity bounds on what a header may announce, so a garbled file fails fast instead of allocating terabytes.
_MAX_NAME = 64 * 1024
_MAX_NDIM = 16
_READ = 16 * 1024 * 1024


class DeltaFormatError(ValueError):
    """The delta is malformed or does not fit the model; the message names the tensor."""


@dataclass
class DeltaRecord:
    name: str
    shape: tuple[int, ...]
    indices: torch.Tensor  # int64, sorted, unique, each < prod(shape)
    values: torch.Tensor  # 1-D, one per index

    @property
    def nbytes(self) -> int:
        return self.indices.numel() * 8 + self.values.numel() * self.values.element_size()


# ------------------------------------------------------------------------------------------ indices


def decode_varint_gaps(raw: np.ndarray, count: int, numel: int, name: str) -> np.ndarray:
    """LEB128 varint gaps (uint8) -> sorted unique int64 indices, all below ``numel``. Vectorized: a varint ends at
    a byte without the 0x80 bit; its 7-bit groups land on disjoint bits, so summing them is OR-ing them."""
    if count == 0:
        if raw.size:
            raise DeltaFormatError(f"{name}: {raw.size} index bytes for no values.")
        return np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero((raw & 0x80) == 0)
    if ends.size != count or ends[-1] != raw.size - 1:
        raise DeltaFormatError(f"{name}: the varint indices hold {ends.size} complete values (the last byte "
                               f"{'ends' if raw.size and not raw[-1] & 0x80 else 'does not end'} one), the values "
                               f"{count}.")
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    if int((ends - starts).max()) >= 9:  # 9 groups of 7 bits hold any gap below 2**63
        raise DeltaFormatError(f"{name}: a varint index gap does not fit 63 bits.")
    pos = np.arange(raw.size, dtype=np.int64) - np.repeat(starts, ends - starts + 1)
    parts = (raw & 0x7F).astype(np.uint64) << (7 * pos).astype(np.uint64)
    gaps = np.add.reduceat(parts, starts)
    if (gaps[1:] == 0).any():
        raise DeltaFormatError(f"{name}: repeated index (a zero gap after the first).")
    if int(gaps.max()) >= numel:
        raise DeltaFormatError(f"{name}: index out of range for {numel} elements.")
    idx = np.cumsum(gaps.astype(np.int64))  # each gap < numel and count <= numel: no overflow for real tensors
    if int(idx[-1]) >= numel:
        raise DeltaFormatError(f"{name}: index {int(idx[-1])} out of range for {numel} elements.")
    return idx


def check_raw_indices(idx: np.ndarray, numel: int, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Raw int32/int64 indices -> (sorted int64 indices, the order that sorted them, None if already sorted)."""
    idx = idx.astype(np.int64, copy=False)
    if idx.size == 0:
        return idx, None
    if int(idx.min()) < 0 or int(idx.max()) >= numel:
        raise DeltaFormatError(f"{name}: index out of range for {numel} elements "
                               f"(min {int(idx.min())}, max {int(idx.max())}).")
    order: np.ndarray | None = None
    if (np.diff(idx) <= 0).any():
        order = np.argsort(idx, kind="stable")
        idx = idx[order]
        if (np.diff(idx) == 0).any():
            raise DeltaFormatError(f"{name}: repeated index.")
    return idx, order


def _indices(raw: np.ndarray, fmt: int, count: int, numel: int, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    if fmt == IDX_VARINT:
        return decode_varint_gaps(raw.view(np.uint8), count, numel, name), None
    width = {IDX_INT32: 4, IDX_INT64: 8}.get(fmt)
    if width is None:
        raise DeltaFormatError(f"{name}: unknown index format {fmt}.")
    if raw.size != count * width:
        raise DeltaFormatError(f"{name}: {raw.size} index bytes for {count} int{width * 8} indices.")
    return check_raw_indices(raw.view(np.int32 if width == 4 else np.int64), numel, name)


def _record(name: str, shape: tuple[int, ...], raw_idx: np.ndarray, fmt: int, values: torch.Tensor) -> DeltaRecord:
    numel = math.prod(shape)
    idx, order = _indices(raw_idx, fmt, values.numel(), numel, name)
    if order is not None:
        values = values[torch.from_numpy(order)]
    return DeltaRecord(name, shape, torch.from_numpy(np.ascontiguousarray(idx)), values.reshape(-1))


# ------------------------------------------------------------------------------------------ containers


def resolve_artifact(path: Path) -> Path:
    """A directory holds ``delta.stream``, else ``delta.safetensors``; a file is itself. FileNotFoundError if none."""
    if path.is_dir():
        for n in (STREAM_NAME, SAFETENSORS_NAME):
            if (path / n).is_file():
                return path / n
        raise FileNotFoundError(f"{path} holds neither {STREAM_NAME} nor {SAFETENSORS_NAME}")
    if not path.is_file():
        raise FileNotFoundError(str(path))
    return path


def is_stream(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def iter_delta(path: Path) -> Iterator[DeltaRecord]:
    """Every record of a delta file (either container), checked and decoded, one at a time."""
    return iter_stream(path) if is_stream(path) else iter_safetensors(path)


def _read(f: IO[bytes], n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise DeltaFormatError(f"delta.stream is truncated in {what} ({len(data)} of {n} bytes).")
    return data


def _read_array(f: IO[bytes], n: int, what: str) -> np.ndarray:
    buf = np.empty(n, dtype=np.uint8)
    got = f.readinto(buf.data) if n else 0  # type: ignore[attr-defined]
    if got != n:
        raise DeltaFormatError(f"delta.stream is truncated in {what} ({got} of {n} bytes).")
    return buf


def iter_stream(path: Path, headers_only: bool = False) -> Iterator[DeltaRecord]:
    """``headers_only``: names and shapes, the data skipped (records carry no indices or values)."""
    size = path.stat().st_size
    with open(path, "rb", buffering=_READ) as f:
        magic, version = HEADER.unpack(_read(f, HEADER.size, "its header"))
        if magic != MAGIC:
            raise DeltaFormatError("not a delta.stream file (bad magic).")
        if version != STREAM_VERSION:
            raise DeltaFormatError(f"delta.stream version {version} is not supported (only {STREAM_VERSION}).")
        seen: set[str] = set()
        while True:
            head = f.read(RECORD.size)
            if not head:
                return
            if len(head) != RECORD.size:
                raise DeltaFormatError("delta.stream is truncated in a record header.")
            name_len, fmt, code, ndim, idx_bytes, count = RECORD.unpack(head)
            if not 0 < name_len <= _MAX_NAME or ndim > _MAX_NDIM:
                raise DeltaFormatError(f"delta.stream record header is corrupt (name length {name_len}, ndim {ndim}).")
            try:
                name = _read(f, name_len, "a tensor name").decode()
            except UnicodeDecodeError:
                raise DeltaFormatError("delta.stream has a tensor name that is not UTF-8.") from None
            dtype = CODE_DTYPES.get(code)
            if dtype is None:
                raise DeltaFormatError(f"{name}: unknown value dtype code {code}.")
            shape = struct.unpack(f"<{ndim}Q", _read(f, 8 * ndim, f"{name}'s shape"))
            value_bytes = count * torch.empty((), dtype=dtype).element_size()
            if idx_bytes + value_bytes > size - f.tell():
                raise DeltaFormatError(f"{name}: the record claims {idx_bytes + value_bytes} bytes, the file has "
                                       f"{size - f.tell()} left.")
            if name in seen:
                raise DeltaFormatError(f"{name}: appears twice.")
            seen.add(name)
            if headers_only:
                f.seek(idx_bytes + value_bytes, 1)
                yield DeltaRecord(name, tuple(int(d) for d in shape), torch.zeros(0, dtype=torch.int64),
                                  torch.zeros(0, dtype=dtype))
                continue
            raw_idx = _read_array(f, idx_bytes, f"{name}'s indices")
            raw_val = _read_array(f, value_bytes, f"{name}'s values")
            values = torch.from_numpy(raw_val).view(dtype) if count else torch.zeros(0, dtype=dtype)
            yield _record(name, tuple(int(d) for d in shape), raw_idx, fmt, values)


def safetensors_meta(path: Path) -> tuple[dict[str, str], list[str]]:
    """A safetensors file's metadata and tensor names (header only)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {}), list(f.keys())


def iter_safetensors(path: Path) -> Iterator[DeltaRecord]:
    from safetensors import SafetensorError, safe_open

    try:
        meta, keys = safetensors_meta(path)
    except (SafetensorError, OSError) as e:
        raise DeltaFormatError(f"{path.name} is not a readable safetensors file ({e}).") from None
    if meta.get(FORMAT_KEY) != FORMAT:
        raise DeltaFormatError(f"{path.name}: metadata {FORMAT_KEY}={meta.get(FORMAT_KEY)!r}, expected {FORMAT!r}.")
    if meta.get(LAYOUT_KEY, LAYOUT) != LAYOUT:
        raise DeltaFormatError(f"{path.name}: metadata {LAYOUT_KEY}={meta.get(LAYOUT_KEY)!r}; only {LAYOUT!r} "
                               "(Hugging Face names and shapes) is supported.")
    try:
        shapes = json.loads(meta.get(SHAPES_KEY, "{}"))
        shapes = {str(k): tuple(int(d) for d in v) for k, v in shapes.items()}
    except (ValueError, TypeError, AttributeError):
        raise DeltaFormatError(f"{path.name}: metadata {SHAPES_KEY} is not a JSON object of shapes.") from None
    names = {k[: -len(IDX_SUFFIX)] for k in keys if k.endswith(IDX_SUFFIX)}
    vals = {k[: -len(VAL_SUFFIX)] for k in keys if k.endswith(VAL_SUFFIX)}
    stray = [k for k in keys if not k.endswith((IDX_SUFFIX, VAL_SUFFIX))]
    if stray:
        raise DeltaFormatError(f"{path.name}: tensor(s) {stray[:4]} are neither NAME{IDX_SUFFIX} nor NAME{VAL_SUFFIX}.")
    if names != vals:
        raise DeltaFormatError(f"{path.name}: tensors without their pair: {sorted(names ^ vals)[:4]}.")
    unshaped = sorted(n for n in names if n not in shapes)
    if unshaped:
        raise DeltaFormatError(f"{path.name}: no shape in {SHAPES_KEY} for {unshaped[:4]}.")
    with safe_open(str(path), framework="pt") as f:
        for name in sorted(names):
            idx = f.get_tensor(name + IDX_SUFFIX)
            val = f.get_tensor(name + VAL_SUFFIX)
            if idx.dim() != 1 or val.dim() != 1:
                raise DeltaFormatError(f"{name}: {IDX_SUFFIX} and {VAL_SUFFIX} must be 1-D.")
            fmt = {torch.uint8: IDX_VARINT, torch.int32: IDX_INT32, torch.int64: IDX_INT64}.get(idx.dtype)
            if fmt is None:
                raise DeltaFormatError(f"{name}: index dtype {idx.dtype} (uint8 varint, int32 or int64 only).")
            if val.dtype not in DTYPE_CODES:
                raise DeltaFormatError(f"{name}: value dtype {val.dtype} is not supported.")
            yield _record(name, shapes[name], idx.contiguous().view(torch.uint8).numpy(), fmt, val)


# ------------------------------------------------------------------------------------------ checks and prepared form


def check_against(rec: DeltaRecord, shape: tuple[int, ...], tag: str) -> None:
    """The record fits a model tensor of ``shape`` and safetensors dtype ``tag``; else DeltaFormatError."""
    if tuple(rec.shape) != tuple(shape):
        raise DeltaFormatError(f"shape mismatch for {rec.name!r}: the delta has {list(rec.shape)}, the model "
                               f"{list(shape)}.")
    floats = rec.values.dtype.is_floating_point
    if tag in FLOAT_TAGS and not floats or tag in INT_TAGS and floats or tag not in FLOAT_TAGS | INT_TAGS:
        raise DeltaFormatError(f"{rec.name!r}: values of dtype {rec.values.dtype} cannot be added to a {tag} "
                               "tensor.")


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def gather(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``flat[idx]``; on CPU through numpy on the raw bits (about 3x torch's advanced indexing on large tensors)."""
    if flat.device.type != "cpu":
        return flat[idx.to(flat.device)]
    bits = flat.view(_BITS[flat.element_size()]).numpy()
    return torch.from_numpy(bits[idx.numpy()]).view(flat.dtype)


def scatter(flat: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[idx] = values`` (``values`` already in ``flat``'s dtype); numpy on CPU as in ``gather``."""
    if flat.device.type != "cpu":
        flat[idx.to(flat.device)] = values.to(flat.device)
        return
    bits = flat.view(_BITS[flat.element_size()]).numpy()
    bits[idx.numpy()] = values.contiguous().view(_BITS[flat.element_size()]).numpy()


def apply_to(flat: torch.Tensor, rec: DeltaRecord) -> None:
    """``flat[idx] = (flat[idx] promoted + values) -> flat's dtype``, in place: the base plus the delta in the wider of
    the two dtypes, rounded back once (what reproduces the trainer's target bit for bit)."""
    if rec.indices.numel() == 0:
        return
    wide = torch.promote_types(flat.dtype, rec.values.dtype)
    old = gather(flat, rec.indices)
    scatter(flat, rec.indices, (old.to(wide) + rec.values.to(old.device, wide)).to(flat.dtype))


class StreamWriter:
    """Writes tito's prepared delta: the stream container with raw int64 indices (sorted, unique), record by record."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.f.write(HEADER.pack(MAGIC, STREAM_VERSION))

    def write(self, rec: DeltaRecord) -> None:
        name = rec.name.encode()
        idx = rec.indices.to(torch.int64).contiguous()
        val = rec.values.contiguous()
        self.f.write(RECORD.pack(len(name), IDX_INT64, DTYPE_CODES[val.dtype], len(rec.shape), idx.numel() * 8,
                                 val.numel()))
        self.f.write(name)
        self.f.write(struct.pack(f"<{len(rec.shape)}Q", *rec.shape))
        self.f.write(idx.numpy().tobytes())
        if val.numel():
            self.f.write(val.view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
