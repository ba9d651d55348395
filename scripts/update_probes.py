"""What scripts/bench_updates.py watches while a server updates its weights: the memory of its process tree, the
events of clients streaming from it, and the read speed of the checkpoint's files."""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
from pathlib import Path

import httpx

NAME = "bench"  # served model name (scripts/bench_openai.py)


def proc_mem(pid: int) -> tuple[int, int]:
    """(RSS, anonymous RSS) in bytes of ``pid`` and its descendants, from /proc (cheap enough for 10 Hz)."""
    import psutil

    try:
        pids = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return 0, 0
    rss = anon = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("RssAnon:"):
                    anon += int(line.split()[1]) * 1024
        except OSError:
            pass
    return rss, anon


class Sampler:
    """The server tree's memory every 0.1 s in a thread: ``(t, rss, anon)``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.monotonic(), *proc_mem(self.pid)))
            self.stop.wait(0.1)

    def steady(self, t0: float) -> tuple[float, float]:
        xs = [s for s in self.samples if t0 - 2.0 <= s[0] < t0] or self.samples[-1:]
        return statistics.median(s[1] for s in xs), statistics.median(s[2] for s in xs)

    def peak(self, t0: float, t1: float) -> tuple[int, int]:
        xs = [s for s in self.samples if t0 <= s[0] <= t1] or self.samples[-1:]
        return max(s[1] for s in xs), max(s[2] for s in xs)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


class Streams:
    """``n`` clients streaming ``/v1/completions`` closed-loop in a thread; each records its events' times."""

    def __init__(self, url: str, n: int, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.events: list[list[float]] = [[] for _ in range(n)]
        self.errors = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _client(self, c: httpx.AsyncClient, i: int) -> None:
        body = {"model": NAME, "prompt": [5 + i] * 16, "max_tokens": self.max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        while not self.stop.is_set():
            try:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            self.events[i].append(time.monotonic())
                        if self.stop.is_set():
                            return
            except httpx.HTTPError:
                self.errors += 1
                await asyncio.sleep(0.2)

    async def _main(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=900) as c:
            await asyncio.gather(*(self._client(c, i) for i in range(len(self.events))))

    def __enter__(self) -> Streams:
        self.thread.start()
        deadline = time.monotonic() + 300
        while min(len(e) for e in self.events) < 5:  # every stream under way
            if time.monotonic() > deadline:
                raise RuntimeError("the streams never started")
            time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)

    def after(self, t: float, timeout: float = 120.0) -> None:
        """Wait until every stream has an event after ``t`` (generating again)."""
        deadline = time.monotonic() + timeout
        while any(not e or e[-1] <= t for e in self.events) and time.monotonic() < deadline:
            time.sleep(0.05)

    def gap(self, t0: float, t1: float) -> float:
        """The longest gap between two events of one stream that overlaps [t0, t1]: the pause it saw."""
        worst = 0.0
        for ev in self.events:
            ev = list(ev)
            for a, b in zip(ev, ev[1:], strict=False):
                if b >= t0 and a <= t1:
                    worst = max(worst, b - a)
        return worst

    def interval(self, t0: float) -> float:
        """The streams' median gap between events in the 5 s before ``t0`` (a token's time under this load)."""
        gaps = [b - a for ev in self.events for a, b in zip(ev, ev[1:], strict=False) if t0 - 5 <= a and b < t0]
        return statistics.median(gaps) if gaps else 0.0


def read_speed(files: list[Path]) -> dict[str, float]:
    """GB/s reading every byte of ``files``: cold (dropped from the page cache first) and warm (right after)."""
    size = sum(f.stat().st_size for f in files)
    out = {}
    for kind in ("cold", "warm"):
        t0 = time.perf_counter()
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                if kind == "cold":
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    t0 = time.perf_counter() if f == files[0] else t0
                while os.read(fd, 64 << 20):
                    pass
            finally:
                os.close(fd)
        out[f"{kind}_gbps"] = size / (time.perf_counter() - t0) / 1e9
    return out
