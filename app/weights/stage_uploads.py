"""Uploads in progress for the staging routes: bytes written at their offsets as they come (in any order, twice is
fine), then a check that every byte is there, the size and the sha256 — Prime-RL's chunked (``/stage_chunk``) and
streaming (``/stage_stream_chunk``) transports. File work runs in threads, never on the event loop.

An upload is keyed by what identifies it to the client (the chunked fields, or the client's ``upload_id``), so a
retried chunk or a retried whole upload lands in the same file. Once finalized, the upload keeps its answer: a repeated
finalize (or init) returns it, and late chunks are acknowledged and dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.core.protocol import ApiError

UPLOAD_COPY_BLOCK = _HASH_BLOCK = 16 * 1024 * 1024

# Staging's file work (chunk writes, copies, hashes: the GIL is released while they run): threads of its own.
_THREADS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tito-stage")
async def background(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in a staging thread, off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_THREADS, lambda: fn(*args))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def merge(ranges: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """Add [start, end) to sorted, disjoint ``ranges``; touching ranges merge."""
    if start >= end:
        return ranges
    out: list[tuple[int, int]] = []
    for a, b in sorted([*ranges, (start, end)]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered(ranges: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in ranges)


@dataclass
class Upload:
    key: str
    meta: dict[str, Any]  # version, mode, base_version, filename, (total_size, sha256 for chunked)
    path: Path
    created: float = field(default_factory=time.time)
    ranges: list[tuple[int, int]] = field(default_factory=list)
    chunks: int = 0
    result: dict[str, Any] | None = None  # set once finalized: what every later finalize answers
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def received(self) -> int:
        return covered(self.ranges)


class Uploads:
    """Uploads in progress under ``root``: at most ``limit`` at once (the oldest is dropped for a new one), each at
    most ``max_bytes``."""

    def __init__(self, root: Path, max_bytes: int, limit: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.limit = limit
        self.active: dict[str, Upload] = {}

    def get(self, key: str) -> Upload | None:
        return self.active.get(key)

    def open(self, key: str, meta: dict[str, Any], name: str) -> Upload:
        """The upload under ``key``, created (empty file) if new; the same key with other metadata is a 409."""
        up = self.active.get(key)
        if up is not None:
            if up.meta != meta:
                raise ApiError(409, f"upload {key!r} was started with other fields ({up.meta}); got {meta}.")
            return up
        while len(self.active) >= self.limit:
            oldest = min(self.active.values(), key=lambda u: u.created)
            self.drop(oldest.key)
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{name}.part"
        path.unlink(missing_ok=True)
        path.touch()
        up = self.active[key] = Upload(key, meta, path)
        return up

    def drop(self, key: str) -> None:
        up = self.active.pop(key, None)
        if up is not None:
            up.path.unlink(missing_ok=True)

    async def write(self, up: Upload, offset: int, data: bytes | Path, size: int) -> None:
        """Write ``size`` bytes (``data``: the bytes, or a file holding them) at ``offset``."""
        if offset < 0:
            raise ApiError(400, "offset must be non-negative.", param="offset")
        if offset + size > self.max_bytes:
            raise ApiError(413, f"upload would reach {offset + size} bytes, over the limit of {self.max_bytes} "
                                "(--max-stage-bytes).")
        if up.result is not None or size == 0:
            return  # finalized already (a late retry), or nothing to write

        def put() -> None:
            with open(up.path, "r+b") as f:
                f.seek(offset)
                if isinstance(data, Path):
                    with open(data, "rb") as src:
                        shutil.copyfileobj(src, f, _HASH_BLOCK)
                else:
                    f.write(data)

        async with up.lock:
            if up.result is None and up.key in self.active:
                await _io(put)
                up.ranges = merge(up.ranges, offset, offset + size)
                up.chunks += 1

    async def finish(self, up: Upload, size: int, sha256: str | None,
                     complete: Callable[[Path, str], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """Check the upload (every byte of [0, size), the size, the sha256) and hand the file to ``complete(path,
        sha256)``; its answer is kept and returned by every repeat. A bad sha256 discards the upload (409)."""
        async with up.lock:
            if up.result is not None:
                return up.result
            if size > self.max_bytes:
                raise ApiError(413, f"upload of {size} bytes is over the limit of {self.max_bytes} "
                                    "(--max-stage-bytes).")
            if up.ranges != ([] if size == 0 else [(0, size)]):
                raise ApiError(409, f"upload incomplete: {up.received} of {size} bytes received "
                                    f"(ranges {up.ranges[:4]}).")
            actual = (await _io(up.path.stat)).st_size
            if actual != size:
                raise ApiError(409, f"upload size mismatch: {actual} bytes on disk, {size} announced.")
            digest = await _io(sha256_file, up.path)
            if sha256 is not None and digest != sha256.lower():
                self.drop(up.key)
                raise ApiError(409, f"sha256 mismatch: expected {sha256}, got {digest}; the upload was discarded.")
            up.result = await complete(up.path, digest)
            return up.result


async def _io(fn: Callable[..., Any], *args: Any) -> Any:
    """File work off the event loop; a full disk is the server's (transient) problem: 507, which clients retry."""
    try:
        return await background(fn, *args)
    except OSError as e:
        if e.errno in (28, 122):  # ENOSPC, EDQUOT
            raise ApiError(507, f"staging storage is full: {e}") from None
        raise


def safe_component(value: str) -> str:
    """A string usable as one path component (versions and file names come from the network)."""
    out = "".join(c if c.isalnum() or c in "._-" else "_" for c in value)[:128].lstrip(".")
    return out or "unnamed"


def remove_tree(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        os.unlink(path)
