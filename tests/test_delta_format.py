"""Unit tests of the sparse delta codec (app/delta_format.py) against tito's independent test encoder
(tests/delta_encoder.py): both containers, both index encodings, widened values, and every malformed input the
decoder must refuse with a message naming the tensor. No engine."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from app.engine.delta_format import (
    DeltaFormatError,
    DeltaRecord,
    StreamWriter,
    apply_to,
    check_against,
    decode_varint_gaps,
    iter_delta,
    iter_stream,
    resolve_artifact,
)
from tests.delta_encoder import changed, perturb, varint_gaps, write_delta

META = {"prime_rl_delta_format": "sparse_delta_v2", "prime_rl_delta_layout": "huggingface"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()])


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 48, generator=g), "b.weight": torch.randn(300, generator=g).to(torch.bfloat16),
            "c.weight": torch.randn(17, 5, generator=g).to(torch.float16),
            "model.layers.0.mlp.up_proj.weight": torch.randn(40, 8, generator=g).to(torch.bfloat16),
            "d.count": torch.arange(50, dtype=torch.int64)}


def _apply(base: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    got = {k: v.clone() for k, v in base.items()}
    for rec in iter_delta(path):
        apply_to(got[rec.name].view(-1), rec)
    return got


def test_varint_round_trip_including_large_gaps() -> None:
    idx = torch.tensor([0, 1, 5, 127, 128, 300, 16383, 16384, 2**31 + 7, 2**40])
    raw = np.frombuffer(varint_gaps(idx), dtype=np.uint8).copy()
    assert decode_varint_gaps(raw, idx.numel(), 2**41, "t").tolist() == idx.tolist()


@pytest.mark.parametrize("container", ["delta.stream", "delta.safetensors"])
@pytest.mark.parametrize("encoding", ["optimized", "naive"])
def test_round_trip_is_bitwise_exact(tmp_path: Path, container: str, encoding: str) -> None:
    base = _state()
    target = perturb({k: v for k, v in base.items() if v.dtype.is_floating_point}, 0.05, 3, scale=0.01)
    target["d.count"] = base["d.count"] + (torch.arange(50) % 7 == 0).long()
    path = write_delta(tmp_path / container, base, target, encoding)
    got = _apply(base, path)
    for k in target:
        assert torch.equal(_bits(got[k]), _bits(target[k])), k


@pytest.mark.parametrize("dtype,wide", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                        (torch.float32, torch.float64)])
def test_values_are_widened_where_the_dtype_cannot_carry_them(tmp_path: Path, dtype: torch.dtype,
                                                              wide: torch.dtype) -> None:
    """target - base of very different magnitudes rounds in the tensor's dtype: adding it back misses the target."""
    big = 4000.0 if dtype != torch.float32 else 1e8
    base = {"w": torch.tensor([big, 1.0, 3.0, 7.0], dtype=torch.float64).to(dtype)}
    target = {"w": torch.tensor([0.5, 1.0, 3.5, 7.0], dtype=torch.float64).to(dtype)}
    (_, vals), = changed(base, target).values()
    assert vals.dtype == wide
    for name in ("delta.stream", "delta.safetensors"):
        got = _apply(base, write_delta(tmp_path / name, base, target))
        assert torch.equal(_bits(got["w"]), _bits(target["w"]))


def test_stream_writer_round_trip_and_headers_only(tmp_path: Path) -> None:
    base = _state()
    target = perturb(base, 0.1, 4)
    src = write_delta(tmp_path / "delta.safetensors", base, target)
    with StreamWriter(tmp_path / "prepared.stream") as w:
        for rec in iter_delta(src):
            w.write(rec)
    got = _apply(base, tmp_path / "prepared.stream")
    assert all(torch.equal(_bits(got[k]), _bits(target[k])) for k in target)
    heads = list(iter_stream(tmp_path / "prepared.stream", headers_only=True))
    assert {h.name for h in heads} == set(changed(base, target)) and all(h.indices.numel() == 0 for h in heads)


def test_empty_delta_is_valid(tmp_path: Path) -> None:
    base = _state()
    for name in ("delta.stream", "delta.safetensors"):
        assert list(iter_delta(write_delta(tmp_path / name, base, base))) == []


def test_raw_indices_unsorted_are_sorted_with_their_values(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    save_file({"a.__idx": torch.tensor([5, 1, 3], dtype=torch.int32), "a.__val": torch.tensor([50.0, 10.0, 30.0])},
              str(path), metadata={**META, "prime_rl_delta_shapes": json.dumps({"a": [8]})})
    (rec,) = list(iter_delta(path))
    assert rec.indices.tolist() == [1, 3, 5] and rec.values.tolist() == [10.0, 30.0, 50.0]


def _st(path: Path, tensors: dict[str, torch.Tensor], shapes: dict[str, list[int]] | None = None,
        meta: dict[str, str] | None = None) -> Path:
    m = {**META, "prime_rl_delta_shapes": json.dumps(shapes or {"a": [8]}), **(meta or {})}
    save_file(tensors, str(path), metadata=m)
    return path


BAD_ST = {
    "duplicate raw index": ({"a.__idx": torch.tensor([1, 1], dtype=torch.int32), "a.__val": torch.ones(2)}, None,
                            None, "repeated index"),
    "index out of range": ({"a.__idx": torch.tensor([8], dtype=torch.int64), "a.__val": torch.ones(1)}, None, None,
                           "out of range"),
    "negative index": ({"a.__idx": torch.tensor([-1], dtype=torch.int32), "a.__val": torch.ones(1)}, None, None,
                       "out of range"),
    "count mismatch": ({"a.__idx": torch.tensor([1, 2], dtype=torch.int32), "a.__val": torch.ones(3)}, None, None,
                       "index bytes"),
    "varint zero gap": ({"a.__idx": torch.tensor([1, 0], dtype=torch.uint8), "a.__val": torch.ones(2)}, None, None,
                        "repeated index"),
    "varint truncated": ({"a.__idx": torch.tensor([0x81], dtype=torch.uint8), "a.__val": torch.ones(1)}, None,
                         None, "complete values"),
    "missing pair": ({"a.__idx": torch.tensor([1], dtype=torch.int32)}, None, None, "without their pair"),
    "stray tensor": ({"a.__idx": torch.tensor([1], dtype=torch.int32), "a.__val": torch.ones(1), "x": torch.ones(1)},
                     None, None, "neither"),
    "no shape": ({"b.__idx": torch.tensor([1], dtype=torch.int32), "b.__val": torch.ones(1)}, None, None,
                 "no shape"),
    "wrong format": ({"a.__idx": torch.tensor([1], dtype=torch.int32), "a.__val": torch.ones(1)}, None,
                     {"prime_rl_delta_format": "sparse_delta_v1"}, "expected 'sparse_delta_v2'"),
    "fused layout": ({"a.__idx": torch.tensor([1], dtype=torch.int32), "a.__val": torch.ones(1)}, None,
                     {"prime_rl_delta_layout": "vllm"}, "only 'huggingface'"),
    "float index": ({"a.__idx": torch.tensor([1.0]), "a.__val": torch.ones(1)}, None, None, "index dtype"),
}


@pytest.mark.parametrize("case", sorted(BAD_ST))
def test_malformed_safetensors_delta_is_refused(tmp_path: Path, case: str) -> None:
    tensors, shapes, meta, words = BAD_ST[case]
    with pytest.raises(DeltaFormatError, match=words):
        list(iter_delta(_st(tmp_path / "d.safetensors", tensors, shapes, meta)))


def _stream(path: Path, *records: bytes, version: int = 2, magic: bytes = b"PDELSTRM") -> Path:
    path.write_bytes(struct.pack("<8sI", magic, version) + b"".join(records))
    return path


def _rec(name: str = "a", fmt: int = 1, code: int = 3, shape: tuple[int, ...] = (8,), idx: bytes = b"",
         vals: bytes = b"", count: int | None = None) -> bytes:
    n = name.encode()
    head = struct.pack("<IBBHQQ", len(n), fmt, code, len(shape), len(idx),
                       count if count is not None else len(vals) // {3: 4, 2: 2}.get(code, 4))
    return head + n + struct.pack(f"<{len(shape)}Q", *shape) + idx + vals


ONE = struct.pack("<i", 2)
F1 = struct.pack("<f", 1.0)
BAD_STREAM = {
    "bad magic": (lambda p: _stream(p, magic=b"NOTDELTA"), "not a readable safetensors file"),
    "version 1": (lambda p: _stream(p, version=1), "version 1"),
    "truncated header": (lambda p: _stream(p, _rec(idx=ONE, vals=F1)[:10]), "truncated in a record header"),
    "truncated data": (lambda p: _stream(p, _rec(idx=ONE, vals=F1)[:-2]), "claims"),
    "unknown dtype": (lambda p: _stream(p, _rec(code=99, idx=ONE, vals=F1, count=1)), "dtype code 99"),
    "unknown index format": (lambda p: _stream(p, _rec(fmt=7, idx=ONE, vals=F1)), "index format 7"),
    "duplicate record": (lambda p: _stream(p, _rec(idx=ONE, vals=F1), _rec(idx=ONE, vals=F1)), "twice"),
    "index out of range": (lambda p: _stream(p, _rec(idx=struct.pack("<i", 8), vals=F1)), "out of range"),
}


@pytest.mark.parametrize("case", sorted(BAD_STREAM))
def test_malformed_stream_delta_is_refused(tmp_path: Path, case: str) -> None:
    make, words = BAD_STREAM[case]
    with pytest.raises(DeltaFormatError, match=words):
        list(iter_delta(make(tmp_path / "delta.stream")))


def test_stream_reader_checks_the_magic(tmp_path: Path) -> None:
    with pytest.raises(DeltaFormatError, match="bad magic"):
        list(iter_stream(_stream(tmp_path / "x", magic=b"NOTDELTA")))


def test_check_against_model_shape_and_dtype(tmp_path: Path) -> None:
    (rec,) = list(iter_delta(_stream(tmp_path / "delta.stream", _rec(idx=ONE, vals=F1))))
    check_against(rec, (8,), "F32")
    check_against(rec, (8,), "BF16")  # float32 values widened for a bf16 tensor
    with pytest.raises(DeltaFormatError, match="shape mismatch"):
        check_against(rec, (2, 4), "F32")
    with pytest.raises(DeltaFormatError, match="cannot be added to a I64"):
        check_against(rec, (8,), "I64")


def test_resolve_artifact_prefers_the_stream(tmp_path: Path) -> None:
    (tmp_path / "delta.safetensors").write_bytes(b"x")
    assert resolve_artifact(tmp_path).name == "delta.safetensors"
    (tmp_path / "delta.stream").write_bytes(b"x")
    assert resolve_artifact(tmp_path).name == "delta.stream"
    with pytest.raises(FileNotFoundError):
        resolve_artifact(tmp_path / "nothing")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_delta_made_ready_is_taken_back_out_bit_for_bit(dtype: torch.dtype) -> None:
    """The workers add a staged delta to their copy before the commit (app/engine/worker_delta.py); when another
    version is committed instead, the copy goes back to its base exactly, whatever rounding the addition did."""
    from app.engine.delta_copy import DeltaCache
    from app.engine.worker_delta import apply_undoable, undo
    from app.engine.worker_prebuild import Pending

    g = torch.Generator().manual_seed(5)
    base = {"a": torch.randn(64, 32, generator=g).to(dtype), "b": torch.randn(100, generator=g).to(dtype)}
    c = DeltaCache(version="base", tensors={k: v.clone() for k, v in base.items()}, ready=True)
    p = Pending("v1", "base", "unused")
    for name, t in base.items():
        idx = torch.randperm(t.numel(), generator=g)[: t.numel() // 7].sort().values
        rec = DeltaRecord(name, tuple(t.shape), idx, torch.randn(idx.numel(), generator=g) * 1e-3)
        p.undo.append((name, idx, apply_undoable(c.tensors[name].view(-1), rec)))
        assert not torch.equal(c.tensors[name], t)
    undo(c, p)
    for name, t in base.items():
        assert torch.equal(c.tensors[name].view(torch.int8), t.view(torch.int8)), name
    assert p.undo == [] and p.prebuilt == {}


def test_the_preparation_stops_while_the_host_keeps_its_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta's layers are processed ahead only while the host keeps a margin of room for anonymous memory (8 %, at
    least 2 GiB): each holds a second copy of its weights until the commit, and at Qwen3-4B's shape on a 24 GB host all
    of them pushed the worker out of memory. The room is the host's memory less what anonymous memory and the kernel
    hold, not MemAvailable: the page cache (the checkpoint's files, a ``--delta-copy file`` mapping) is no room for
    anonymous memory, and with MemAvailable as the measure the worker was killed at 23 of 24 GB anonymous."""
    from types import SimpleNamespace

    import psutil

    from app.engine import delta_copy

    total = 24 << 30
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=total // 2, total=total))
    for anon, spare in (((24 << 30) * 8 // 10, True), (total - (2 << 30), False), (int(0.93 * total), False)):
        # A page cache of 12 GB that MemAvailable would count: it makes no room here.
        info = {"MemTotal": total, "MemAvailable": total - anon + (12 << 30), "AnonPages": anon, "Shmem": 0,
                "SUnreclaim": 0, "PageTables": 0, "KernelStack": 0, "Unevictable": 0}
        monkeypatch.setattr(delta_copy, "meminfo", lambda i=info: i)
        assert delta_copy.available_bytes() == total - anon
        assert delta_copy.memory_to_spare() is spare, anon
    # What the next layer is about to take counts: 4.8 GiB of room, less 3 GiB, leaves less than the margin.
    monkeypatch.setattr(delta_copy, "meminfo", lambda: {"MemTotal": total, "AnonPages": total * 8 // 10})
    assert delta_copy.memory_to_spare(1 << 30) is True and delta_copy.memory_to_spare(3 << 30) is False
    # A small host: the 2 GiB floor, not the 8 %.
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=1 << 30, total=8 << 30))
    monkeypatch.setattr(delta_copy, "meminfo", lambda: {"MemTotal": 8 << 30, "AnonPages": 7 << 30})
    assert delta_copy.memory_to_spare() is False
    # This host's own /proc/meminfo is read.
    monkeypatch.undo()
    assert 0 < delta_copy.available_bytes() <= psutil.virtual_memory().total


def test_the_preparation_gives_freed_memory_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """``give_back_memory`` calls glibc's ``malloc_trim`` a moment later, in a thread of its own."""
    import ctypes
    import threading

    from app.engine import delta_copy

    called = threading.Event()

    class Libc:
        def malloc_trim(self, pad: int) -> int:
            assert pad == 0
            called.set()
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    delta_copy.give_back_memory(delay=0.0)
    assert called.wait(10)


def test_where_hf_elements_land_is_the_same_read_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``trace_param`` reads the traced copy a chunk at a time (whole-tensor temporaries of a 4B model's tied
    embedding took ~10 GB of the worker): runs that cross a chunk's edge are joined, and every layout comes out as
    read whole. The loaders here place an HF tensor as vLLM's do: rows into a padded vocabulary, a shard into its
    slot of a fused parameter, a transpose (runs of one element)."""
    from app.engine import weight_layout

    def padded_rows(param: torch.Tensor, w: torch.Tensor) -> None:
        param.data[: w.shape[0]].copy_(w)
        param.data[w.shape[0]:] = 0

    def fused_slot(param: torch.Tensor, w: torch.Tensor, shard: int) -> None:
        param.data[shard * w.shape[0]:(shard + 1) * w.shape[0]].copy_(w)

    def transposed(param: torch.Tensor, w: torch.Tensor) -> None:
        param.data.copy_(w.t())

    cases = [((37, 6), (40, 6), padded_rows, None), ((5, 9), (15, 9), fused_slot, 1),
             ((7, 4), (4, 7), transposed, None)]
    for hf_shape, p_shape, loader, shard in cases:
        param = torch.nn.Parameter(torch.zeros(p_shape), requires_grad=False)
        param.weight_loader = loader  # type: ignore[attr-defined]
        monkeypatch.setattr(weight_layout, "TRACE_CHUNK", 1 << 24)
        whole = weight_layout.trace_param(param, shard, hf_shape)
        for chunk in (1, 3, 7, 64):
            monkeypatch.setattr(weight_layout, "TRACE_CHUNK", chunk)
            got = weight_layout.trace_param(param, shard, hf_shape)
            assert whole is not None and got is not None
            for field in ("hf_start", "p_start", "length"):
                assert torch.equal(getattr(got, field), getattr(whole, field)), (loader.__name__, chunk, field)
        # And the runs say where each HF element is: placing 1..n through them gives what the loader gave.
        target = torch.zeros(p_shape)
        loader(target, torch.arange(1, math.prod(hf_shape) + 1, dtype=torch.float32).view(hf_shape),
               *(() if shard is None else (shard,)))
        rebuilt = torch.zeros(p_shape).view(-1)
        for h, p, n in zip(whole.hf_start.tolist(), whole.p_start.tolist(), whole.length.tolist(), strict=True):
            rebuilt[p:p + n] = torch.arange(h + 1, h + n + 1, dtype=torch.float32)
        assert torch.equal(rebuilt.view(p_shape), target), loader.__name__
