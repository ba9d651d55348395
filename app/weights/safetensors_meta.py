"""The one safetensors header reader: names, dtypes and shapes of a file's tensors, never their data.

The ``safetensors`` package (the library vLLM loads checkpoints with) parses and validates the header and answers the
names, shapes and dtypes (``safe_open(...).keys()/get_slice().get_shape()/get_dtype()``). Its refusals are terse
("incomplete metadata, file not fully covered"), so a first pass over the raw header names the problem for the
client instead: the header length against the file size, the JSON, each tensor's byte range against its dtype and
shape, and that the ranges tile the data section up to the end of the file (a truncated or padded file fails).

Stdlib and ``safetensors`` only: ``app.engine.worker`` may import it inside vLLM's worker processes.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

# A safetensors header is JSON; anything this large is corruption, not a real checkpoint.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# Bits per element of every dtype tag the format defines (sub-byte types pack; a tensor's bytes round up).
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E5M2FNUZ": 8,
              "F8_E4M3FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64}


class HeaderError(ValueError):
    """The file is not a whole, well-formed safetensors file; the message names the problem and the file."""


@dataclass(frozen=True)
class TensorMeta:
    dtype: str  # safetensors dtype tag: F32, BF16, ...
    shape: tuple[int, ...]


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return (math.prod(shape) * DTYPE_BITS[dtype] + 7) // 8


def _check_layout(path: Path) -> None:
    """Name what is wrong with the raw header and byte layout, if anything (see the module docstring)."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HeaderError(f"{name} is truncated or not a safetensors file: {size} bytes, too short for a "
                                  "header.")
            (n,) = struct.unpack("<Q", head)
            if n <= 0 or n > MAX_HEADER_BYTES or 8 + n > size:
                raise HeaderError(f"{name} is corrupt or truncated: header length {n} does not fit a file of {size} "
                                  "bytes.")
            raw = f.read(n)
    except OSError as e:
        raise HeaderError(f"cannot read {name}: {e.strerror or e}.") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise HeaderError(f"{name} is corrupt: its header is not valid JSON.") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{name} is corrupt: its header is not a JSON object.")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    spans: list[tuple[int, int, str]] = []
    for key, meta in header.items():
        try:
            dtype = str(meta["dtype"])
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise HeaderError(f"{name} is corrupt: bad header entry for tensor {key!r}.") from None
        if dtype not in DTYPE_BITS or any(d < 0 for d in shape):
            raise HeaderError(f"{name} is corrupt: tensor {key!r} has dtype {dtype} and shape {list(shape)}.")
        if end - begin != nbytes(dtype, shape) or begin < 0 or end > data_len:
            raise HeaderError(f"{name} is corrupt or truncated: tensor {key!r} ({dtype} {list(shape)}) claims bytes "
                              f"[{begin}, {end}) of a {data_len}-byte data section.")
        spans.append((begin, end, key))
    pos = 0
    for begin, end, key in sorted(spans):
        if begin != pos:
            raise HeaderError(f"{name} is corrupt: tensor {key!r} starts at byte {begin}, expected {pos}.")
        pos = end
    if pos != data_len:
        raise HeaderError(f"{name} is corrupt or truncated: tensors cover {pos} bytes, the data section has "
                          f"{data_len}.")


def read_tensors(path: Path) -> dict[str, TensorMeta]:
    """``{tensor name: TensorMeta}`` of a safetensors file; ``HeaderError`` when it is not whole and well-formed.

    Blocking file I/O (the header only; the data is memory-mapped by ``safe_open``, never read): call from a thread.
    """
    from safetensors import SafetensorError, safe_open

    _check_layout(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            out = {}
            for key in f.keys():
                sl = f.get_slice(key)
                out[key] = TensorMeta(str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape()))
            return out
    except (SafetensorError, OSError) as e:
        raise HeaderError(f"{path.name} is corrupt: the safetensors library refuses it ({e}).") from None
