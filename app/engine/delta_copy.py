"""The workers' copy of the active weights that a staged delta is added to (app/engine/worker_delta.py): what it
holds, filling it from the active checkpoint (in anonymous memory, or a memory-mapped file with ``--delta-copy file``),
and the host memory it and a delta's preparation may take.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.engine.weight_layout import InPlace, layout_plans
from app.engine.weight_markers import BUFFER_SUFFIXES
from app.engine.worker_prebuild import Pending

log = logging.getLogger("tito.worker.delta")

# Bytes per element of safetensors' dtypes (the copy's size, from the headers alone).
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "U16": 2,
             "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}



@dataclass
class DeltaCache:
    version: str | None = None
    tensors: dict[str, Any] = field(default_factory=dict)  # HF name -> the copy, for tensors not written in place
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # HF name -> shape, every tensor of the version
    mapped: list[Any] = field(default_factory=list)  # --delta-copy file: the mapped files the copy's tensors view
    ready: bool = False
    error: str | None = None
    cancelled: bool = False  # dropped while filling: the fill stops
    thread: threading.Thread | None = None
    seconds: float = 0.0
    plans: dict[str, InPlace | None] = field(default_factory=dict)  # HF name -> in place, or None: reload its group
    groups: dict[str, list[str]] = field(default_factory=dict)  # group -> its HF names (they reload together)
    vllm_names: dict[str, str] = field(default_factory=dict)  # HF name -> vLLM parameter name (fused), when known
    where: dict[str, tuple[str, str, Any]] = field(default_factory=dict)  # HF name -> (module path, param, shard)
    pending: Pending | None = None  # a staged delta made ready before the pause (worker_prebuild.py)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def status(self) -> dict[str, Any]:
        state = "ready" if self.ready else "error" if self.error else "filling" if self.thread else "empty"
        return {"pid": os.getpid(), "version": self.version, "state": state, "error": self.error,
                "copy": "file" if self.mapped else "memory",
                "tensors": len(self.shapes), "copied": len(self.tensors), "bytes": self.nbytes if self.ready else 0,
                "inplace": sum(p is not None for p in self.plans.values()), "seconds": round(self.seconds, 3),
                "pending": self.pending.status() if self.pending is not None else None}


def group_of(name: str, packed: dict[str, list[str]]) -> str:
    """The tensors that vLLM may fuse into one layer reload together: everything under a numbered block
    (``model.layers.3``), else the parent of a packed projection, else the module itself."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    module = ".".join(parts[:-1])
    if len(parts) > 2 and any(parts[-2] in v for v in packed.values()):
        return ".".join(parts[:-2])
    return module



def fill(c: DeltaCache, files: list[str], copy_dir: str | None, model: Any, vllm_config: Any) -> None:
    """Work out from the checkpoint's headers which tensors a commit writes in place (read from the model
    itself), then read the others into host memory (a real copy: the files may be replaced or deleted later).
    Runs beside generation, at its priority (generation shares the CPU with it for a moment, rather than a commit
    doing the work under the pause); touches no live tensor."""
    from safetensors import safe_open

    t0 = time.perf_counter()
    try:
        shapes: dict[str, tuple[int, ...]] = {}
        sizes: dict[str, int] = {}
        for f in files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    if not name.endswith(BUFFER_SUFFIXES):
                        sl = st.get_slice(name)
                        shapes[name] = tuple(sl.get_shape())
                        sizes[name] = math.prod(shapes[name]) * _ITEMSIZE.get(sl.get_dtype(), 4)
            packed = dict(getattr(model, "packed_modules_mapping", None) or {})
        plans, where = layout_plans(model, vllm_config, shapes, packed)
        tensors: dict[str, Any] = {}
        copied = [n for n in shapes if plans.get(n) is None]
        need = sum(sizes[n] for n in copied)
        if copy_dir is None and need > available_bytes() - (2 << 30):
            raise RuntimeError(f"the copy of the weights a delta is added to ({need / 1e9:.1f} GB) does not fit "
                               f"in the host's available memory ({available_bytes() / 1e9:.1f} GB): start tito "
                               "with --delta-copy file (a memory-mapped file the kernel can page out)")
        for f in files:
            with safe_open(f, framework="pt") as st:
                dtypes = {n: st.get_slice(n).get_dtype() for n in st.keys() if n in copied}
                if copy_dir is not None:
                    into = map_copy(c, copy_dir, {n: (shapes[n], dtypes[n]) for n in dtypes})
                for name in dtypes:
                    if c.cancelled:
                        return
                    t = st.get_tensor(name)
                    if copy_dir is None:
                        tensors[name] = t.clone()
                    else:
                        tensors[name] = into[name]
                        tensors[name].copy_(t)
        groups: dict[str, list[str]] = {}
        for name in shapes:
            groups.setdefault(group_of(name, packed), []).append(name)
        c.tensors, c.shapes, c.groups, c.plans, c.where = tensors, shapes, groups, plans, where
        c.vllm_names = {n: f"{m}.{p}" for n, (m, p, _) in where.items()}
        c.seconds = time.perf_counter() - t0
        c.ready = True
        log.info("delta cache: version %s, %d tensors, %d copied (%.0f MB) in %.2fs; %d written in place on commit",
                 c.version, len(shapes), len(tensors), c.nbytes / 1e6, c.seconds,
                 sum(p is not None for p in plans.values()))
    except Exception as e:  # noqa: BLE001 - reported by tito_delta_status / the commit
        c.error = f"{type(e).__name__}: {e}"
        c.tensors = {}
        log.error("delta cache fill failed: %s", c.error)

def map_copy(c: DeltaCache, copy_dir: str, specs: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, Any]:
    """Tensors (name -> (shape, safetensors dtype)) laid out in one new file under ``copy_dir``, memory-mapped
    shared: writes reach the file, and the kernel may drop its clean pages. The file is unlinked at once (it lives
    as long as the mapping: nothing is left behind, whatever ends the process)."""
    import torch

    from app.engine.delta_format import TAG_DTYPES

    names = {**TAG_DTYPES, "BOOL": torch.bool}
    layout, total = {}, 0
    for name, (shape, dt) in specs.items():
        dtype = names[dt]
        size = math.prod(shape) * dtype.itemsize
        layout[name] = (total, size, shape, dtype)
        total += (size + 63) // 64 * 64
    Path(copy_dir).mkdir(parents=True, exist_ok=True)
    path = Path(copy_dir) / f"copy-{os.getpid()}-{time.monotonic_ns()}"
    with open(path, "wb") as f:
        f.truncate(max(total, 1))
    flat = torch.from_file(str(path), shared=True, size=max(total, 1), dtype=torch.uint8)
    path.unlink()
    c.mapped.append(flat)
    return {n: flat[off:off + size].view(dtype).view(shape) for n, (off, size, shape, dtype) in layout.items()}


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty off Linux)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def available_bytes() -> int:
    """Memory that new anonymous allocations (the tensors a delta's preparation builds) can still take: the host's
    memory less what anonymous and shared memory, the kernel's unreclaimable slabs and page tables already hold.
    Not ``MemAvailable``: it counts the page cache as free, and the page cache here is the checkpoint's files and
    the ``--delta-copy file`` mapping, which the kernel can drop or write back but which do not make room for anonymous
    memory fast enough. At Qwen3-4B's shape, MemAvailable kept a margin while the worker's anonymous memory reached
    23 of 24 GB and the kernel killed it."""
    m = meminfo()
    if "MemTotal" not in m or "AnonPages" not in m:
        import psutil

        return int(psutil.virtual_memory().available)
    held = sum(m.get(k, 0) for k in ("AnonPages", "Shmem", "SUnreclaim", "PageTables", "KernelStack", "Unevictable"))
    return max(0, m["MemTotal"] - held)


def memory_to_spare(need: int = 0, floor: float = 0.08, at_least: int = 2 << 30) -> bool:
    """Whether allocating ``need`` more bytes (one more layer processed ahead: its weights, the processing's scratch
    and the packed result) leaves the host a margin (``floor`` of its memory, at least ``at_least`` bytes) of room for
    anonymous memory: a delta's preparation must never be what pushes the engine out of memory."""
    import psutil

    return available_bytes() - need > max(at_least, floor * psutil.virtual_memory().total)


def give_back_memory(delay: float = 1.0) -> None:
    """Hand the memory freed by the copy's and the replaced layers' tensors back to the system, ``delay`` seconds on
    (once the caller has dropped them), in a thread of its own (never under the caller's pause). Tensors of tens of MB
    come from glibc's arenas once its mmap threshold has risen, and glibc keeps what they free for the process: after
    a few deltas at Qwen3-1.7B's shape the worker held 5-7 GB more than before the first (measured), until
    ``malloc_trim``. A no-op off glibc."""
    import ctypes
    import ctypes.util

    def trim() -> None:
        try:
            ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass

    t = threading.Timer(delay, trim)
    t.daemon = True
    t.start()
