"""Helpers for the lifecycle tests: run many SSE generate requests concurrently, poll, and watch processes."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from app.tiny.model import TINY_CONFIG, make_tiny_model

GEN = "/inference/v1/generate"


def stream_body(max_tokens: int, seed: int = 0) -> dict[str, Any]:
    """A greedy streaming request that runs exactly ``max_tokens`` tokens (EOS ignored)."""
    return {"token_ids": [1 + seed % 400, 2, 3, 4], "stream": True,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}


def long_context_model(out_dir: Path, context: int) -> Path:
    """The tiny model with a longer context, so long requests outlast the test's next call on a fast machine."""
    d = make_tiny_model(out_dir)
    (d / "config.json").write_text(json.dumps({**TINY_CONFIG, "max_position_embeddings": context}))
    return d


async def pause_keep(c: httpx.AsyncClient) -> None:
    """Freeze the in-flight requests where they are (they continue after /resume, or end with an abort)."""
    r = await c.post("/pause", params={"mode": "keep"})
    assert r.status_code == 200, r.text


async def resume(c: httpx.AsyncClient) -> None:
    r = await c.post("/resume")
    assert r.status_code == 200, r.text


async def inflight(c: httpx.AsyncClient) -> int:
    """tito's count of generate requests in flight (admitted, not yet answered)."""
    return int((await c.get("/health")).json()["inflight"])


def async_client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=300.0, limits=httpx.Limits(max_connections=256))


async def read_stream(client: httpx.AsyncClient, body: dict[str, Any], first: asyncio.Event | None = None,
                      headers: dict[str, str] | None = None,
                      admitted: asyncio.Event | None = None) -> dict[str, Any]:
    """Run one SSE generate request to the end: its status, tokens, last finish_reason, last weight_versions spans
    and error events.

    ``first`` is set at the first event with tokens; ``admitted`` when the 200 status line arrives (tito counts a
    request in flight before it answers with a stream, so this is a server-side fact, even while paused)."""
    out: dict[str, Any] = {"tokens": [], "finish": None, "spans": None, "errors": [], "done": False}
    async with client.stream("POST", GEN, json=body, headers=headers) as r:
        out["status"] = r.status_code
        if admitted is not None and r.status_code == 200:
            admitted.set()
        if r.status_code != 200:
            out["body"] = json.loads(await r.aread())
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                out["done"] = True
                break
            ev = json.loads(payload)
            if "error" in ev:
                out["errors"].append(ev["error"])
                continue
            for ch in ev["choices"]:
                out["tokens"] += ch["token_ids"]
                out["finish"] = ch["finish_reason"] or out["finish"]
                out["spans"] = ch.get("weight_versions") or out["spans"]
            if first is not None and out["tokens"]:
                first.set()
    return out


async def wait_for(pred: Any, timeout: float, interval: float = 0.05) -> Any:
    """Poll the async predicate until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = await pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


async def count_set(events: list[asyncio.Event], k: int) -> bool:
    return sum(e.is_set() for e in events) >= k


def family(pid: int) -> list[psutil.Process]:
    """Every descendant of ``pid`` (EngineCore, its workers, the DP coordinator, ...)."""
    return psutil.Process(pid).children(recursive=True)


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait for the processes to exit; returns those still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    alive = procs
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    return alive


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
