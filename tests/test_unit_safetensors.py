"""Fast tests (no engine): the one safetensors header reader (app/weights/safetensors_meta.py) names every broken
file."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from app.weights.safetensors_meta import DTYPE_BITS, HeaderError, TensorMeta, read_tensors


@pytest.fixture
def good(tmp_path: Path) -> Path:
    p = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.zeros(4), "e": torch.zeros(0, 2),
               "f8": torch.zeros(3, dtype=torch.float8_e4m3fn)}, str(p), metadata={"format": "pt"})
    return p


def test_reads_names_dtypes_shapes(good: Path) -> None:
    assert read_tensors(good) == {"w": TensorMeta("BF16", (3, 5)), "b": TensorMeta("F32", (4,)),
                                  "e": TensorMeta("F32", (0, 2)), "f8": TensorMeta("F8_E4M3", (3,))}


def _edit(p: Path, fn) -> Path:  # noqa: ANN001
    p.write_bytes(fn(p.read_bytes()))
    return p


def _header_len(raw: bytes) -> int:
    return int(struct.unpack("<Q", raw[:8])[0])


@pytest.mark.parametrize("name,edit,words", [
    ("truncated", lambda r: r[:-3], "truncated"),
    ("half", lambda r: r[: len(r) // 2], "truncated"),
    ("padded", lambda r: r + b"\0" * 8, "corrupt or truncated"),
    ("not_json", lambda r: r[:8] + b"{" * _header_len(r) + r[8 + _header_len(r):], "not valid JSON"),
    ("huge_length", lambda r: struct.pack("<Q", 2**40) + r[8:], "header length"),
    ("tiny_file", lambda r: r[:5], "too short"),
    ("bad_dtype", lambda r: r.replace(b'"BF16"', b'"BX16"'), "dtype BX16"),
])
def test_broken_files_are_named(good: Path, name: str, edit, words: str) -> None:  # noqa: ANN001
    _edit(good, edit)
    with pytest.raises(HeaderError, match=words) as e:
        read_tensors(good)
    assert good.name in str(e.value)


def test_every_dtype_torch_saves_is_in_the_table(tmp_path: Path) -> None:
    from safetensors.torch import _TYPES  # the library's own tag list for torch dtypes

    assert set(_TYPES) <= set(DTYPE_BITS)
