"""What Prime-RL's orchestrator sends for a staged delta step, per the contract (/work/shared/spec/
staged-delta-updates.md): stage over one of four transports while the server generates, then pause (keep), commit,
resume in a ``finally``. Stage, chunk and stream calls are retried on 408/425/429/5xx and transport errors (same
``upload_id``); pause, commit and resume never. For tests and the bench; written from the contract, not copied."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from pathlib import Path
from typing import Any

import httpx

TRANSPORTS = ("path", "multipart", "chunked", "streaming")
RETRY = {408, 425, 429}


async def post(c: httpx.AsyncClient, route: str, retries: int = 3, **kw: Any) -> httpx.Response:
    """A stage-family call: retried on transient answers, any other 4xx is final (raised)."""
    for attempt in range(retries + 1):
        try:
            r = await c.post(route, **kw)
        except httpx.TransportError:
            if attempt == retries:
                raise
        else:
            if not (r.status_code in RETRY or r.status_code >= 500) or attempt == retries:
                r.raise_for_status()
                return r
        await asyncio.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


def artifact(step_dir: Path, transport: str) -> Path:
    """The file a transport sends: streaming (and a server resolving a path) prefers delta.stream, uploads
    delta.safetensors."""
    first, second = ("delta.stream", "delta.safetensors") if transport in ("streaming", "path") else \
        ("delta.safetensors", "delta.stream")
    return step_dir / first if (step_dir / first).exists() else step_dir / second


async def stage(c: httpx.AsyncClient, step_dir: Path, version: str, base: str, transport: str,
                chunk_size: int = 64 * 1024, streams: int = 2) -> dict[str, Any]:
    """Stage the delta in ``step_dir`` on one server; returns the final answer's JSON."""
    data = {"version": version, "mode": "delta", "base_version": base}
    if transport == "path":
        return (await post(c, "/stage", data={**data, "path": step_dir.as_posix()})).json()
    path = artifact(step_dir, transport)
    raw = path.read_bytes()
    sha = hashlib.sha256(raw).hexdigest()
    if transport == "multipart":
        return (await post(c, "/stage", data=data, files={"file": (path.name, raw, "application/octet-stream")})).json()
    ranges = [(o, raw[o:o + chunk_size]) for o in range(0, len(raw), chunk_size)] or [(0, b"")]
    if transport == "chunked":
        fields = {**data, "filename": path.name, "total_size": str(len(raw)), "sha256": sha}
        queue = list(reversed(ranges))  # out of order on purpose

        async def worker() -> None:
            while queue:
                off, part = queue.pop()
                await post(c, "/stage_chunk", data={**fields, "offset": str(off)},
                           files={"file": (path.name, part, "application/octet-stream")})

        await asyncio.gather(*(worker() for _ in range(streams)))
        return (await post(c, "/stage_finalize", data=fields)).json()
    assert transport == "streaming", transport
    upload_id = uuid.uuid4().hex
    init = (await post(c, "/stage_stream_init", json={**data, "filename": path.name, "upload_id": upload_id})).json()
    assert init["upload_id"] == upload_id, init
    if not init.get("finalized"):
        for i, (off, part) in enumerate(ranges):
            await post(c, "/stage_stream_chunk", params={"upload_id": upload_id, "chunk_index": i, "offset": off},
                       content=part)
    return (await post(c, "/stage_stream_finalize",
                       data={"upload_id": upload_id, "final_size": str(len(raw)), "sha256": sha})).json()


async def commit(c: httpx.AsyncClient, version: str, mode: str = "delta") -> httpx.Response:
    """pause (keep) -> commit -> resume (in finally); the commit's answer, unchecked."""
    r = await c.post("/pause", params={"mode": "keep", "clear_cache": "false"})
    r.raise_for_status()
    try:
        return await c.post("/commit", data={"version": version, "mode": mode})
    finally:
        await c.post("/resume")
