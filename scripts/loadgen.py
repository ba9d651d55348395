"""The closed-loop HTTP load generator shared by the benchmarks (scripts/bench*.py) and the soak (scripts/soak.py).

A workload (``Workload``: clients, new tokens, streamed or not, how many requests) is the same requests for every
system (``request_spec``). ``closed_loop`` drives it: each client sends its next request as soon as the last one
answered, and every failure is counted and sampled, never fatal. ``raw_load`` sends over one keep-alive HTTP/1.1
connection per client (``_Conn``: httptools, a bare asyncio protocol, the least client CPU per request);
``aiohttp_load`` is the older, costlier one. ``process_cpu_s`` reads a process's own CPU time.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

GEN_PATH = "/inference/v1/generate"
LOAD_TIMEOUT_S = 600.0  # a whole workload; a hung server fails the run instead of stalling it


@dataclass(frozen=True)
class Workload:
    name: str
    clients: int
    max_tokens: int  # 0 = mixed lengths
    stream: bool
    requests: int
    metric: str  # the headline number: tok/s, req/s or p50
    prompt_len: int = 16  # prompt tokens of a fixed-length workload (max_tokens > 0)

    def scaled(self, quick: bool) -> Workload:
        if not quick:
            return self
        c = min(self.clients, 4)
        return Workload(self.name, c, min(self.max_tokens, 8) if self.max_tokens else 0, self.stream, c * 2,
                        self.metric, self.prompt_len)



def request_spec(wl: Workload, i: int) -> tuple[list[int], int]:
    """The prompt and max_tokens of request ``i`` of a workload: the same for every system."""
    rng = random.Random(f"{wl.name}-{i}")
    if wl.max_tokens:
        plen, max_tokens = wl.prompt_len, wl.max_tokens
    else:
        plen, max_tokens = rng.choice((8, 32, 128, 256)), rng.choice((1, 8, 32, 128))
        if wl.requests <= 16:  # --quick: keep the smoke short
            plen, max_tokens = min(plen, 32), min(max_tokens, 8)
    return [rng.randrange(3, 500) for _ in range(plen)], max_tokens


def sampling(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}


def summarize(wall: float, latencies: list[float], tokens: int, ok: int, errors: int,
              samples: list[str]) -> dict[str, Any]:
    lat = sorted(latencies)

    def pct(p: float) -> float | None:
        if not lat:
            return None
        return lat[min(len(lat) - 1, int(round(p / 100 * (len(lat) - 1))))] * 1000.0

    return {"wall_s": wall, "requests": ok + errors, "ok": ok, "errors": errors, "tokens": tokens,
            "tok_s": tokens / wall if wall > 0 else 0.0, "req_s": ok / wall if wall > 0 else 0.0,
            "p50_ms": pct(50), "p99_ms": pct(99), "error_samples": samples[:5]}


def process_cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (all its threads; not its children). Unlike throughput, this barely
    moves when other processes share the machine, so it shows the serving process's own cost per request."""
    if pid is None:
        return time.process_time()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def with_cpu(res: dict[str, Any], cpu_s: float) -> dict[str, Any]:
    res["cpu_ms_per_req"] = cpu_s * 1000.0 / res["ok"] if res["ok"] else None
    return res


# --------------------------------------------------------------------------------------------------- HTTP load


def _bodies(wl: Workload) -> list[bytes]:
    import orjson

    out = []
    for i in range(wl.requests):
        prompt, mt = request_spec(wl, i)
        body: dict[str, Any] = {"token_ids": prompt, "sampling_params": sampling(mt)}
        if wl.stream:
            body["stream"] = True
        out.append(orjson.dumps(body))
    return out


def sse_events(body: bytes) -> tuple[list[Any], bool]:
    """The JSON events of a whole SSE answer up to ``data: [DONE]``, and whether that came (a cut stream: False)."""
    import orjson

    events: list[Any] = []
    for event in body.split(b"\n\n"):
        line = event.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return events, True
        events.append(orjson.loads(payload))
    return events, False


def _count_tokens(body: bytes, stream: bool) -> int:
    """Tokens in a whole answer (JSON, or SSE events ending with [DONE]); raises on an error event or a cut stream."""
    import orjson

    if not stream:
        return sum(len(c["token_ids"]) for c in orjson.loads(body)["choices"])
    events, done = sse_events(body)
    got = 0
    for ev in events:
        if "error" in ev:
            raise RuntimeError(f"error event: {ev['error']}")
        got += sum(len(c.get("token_ids") or ()) for c in ev.get("choices") or ())
    if not done:
        raise RuntimeError("stream ended without [DONE]")
    return got


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of the lean load generator: httptools (C) parses the answer and the body is
    only looked at once it is complete, so the client spends as little CPU per request as it can. On a 2-core
    machine every millisecond the client spends is taken from the server it measures."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.chunks: list[bytes] = []
        self.status = 0
        self.keep_alive = True

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception as e:  # noqa: BLE001 - a malformed answer fails this request, not the run
            self._fail(RuntimeError(f"bad HTTP answer: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._fail(ConnectionError(f"server closed the connection: {exc or 'EOF'}"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.status, b"".join(self.chunks)))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    async def request(self, head: bytes, body: bytes) -> tuple[int, bytes]:
        assert self.transport is not None
        self.chunks = []
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(head + b"%d\r\n\r\n" % len(body) + body)
        return await self.waiter


async def closed_loop(wl: Workload, send: Callable[[int, int], Awaitable[int]]) -> dict[str, Any]:
    """Drive a workload closed-loop: ``wl.clients`` clients each send their next request as soon as the last one
    answered. ``send(client, i)`` sends request ``i`` and returns the tokens it got; any exception, or fewer tokens
    than the request's ``max_tokens``, is one error (counted and sampled, never fatal)."""
    wants = [request_spec(wl, i)[1] for i in range(wl.requests)]
    latencies: list[float] = []
    samples: list[str] = []
    tokens = ok = errors = 0
    nxt = 0

    async def client(c: int) -> None:
        nonlocal nxt, tokens, ok, errors
        while nxt < wl.requests:
            i = nxt
            nxt += 1
            t0 = time.perf_counter()
            try:
                got = await send(c, i)  # not `tokens += await ...`: that reads `tokens` before the await
                if got < wants[i]:
                    raise RuntimeError(f"short answer: {got} of {wants[i]} tokens")
                tokens += got
                ok += 1
                latencies.append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - every failure is counted and sampled, never fatal
                errors += 1
                samples.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(client(c) for c in range(wl.clients))), LOAD_TIMEOUT_S)
    return summarize(time.perf_counter() - t0, latencies, tokens, ok, errors, samples)


async def raw_load(url: str, wl: Workload) -> dict[str, Any]:
    """The default load generator: one keep-alive connection per client over a bare asyncio protocol."""
    host, _, port = url.removeprefix("http://").partition(":")
    head = (f"POST {GEN_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            "Content-Length: ").encode()
    bodies = _bodies(wl)
    loop = asyncio.get_running_loop()
    conns: list[_Conn | None] = [None] * wl.clients

    async def send(c: int, i: int) -> int:
        conn = conns[c]
        try:
            if conn is None or conn.transport is None:
                _, conn = await loop.create_connection(_Conn, host, int(port))
                conns[c] = conn
            status, body = await conn.request(head, bodies[i])
        except BaseException:
            if conn is not None and conn.transport is not None:
                conn.transport.close()  # the connection's state is unknown: the next request opens a fresh one
            conns[c] = None
            raise
        if not conn.keep_alive and conn.transport is not None:
            conn.transport.close()
            conns[c] = None
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body[:200]!r}")
        return _count_tokens(body, wl.stream)

    try:
        return await closed_loop(wl, send)
    finally:
        for conn in conns:
            if conn is not None and conn.transport is not None:
                conn.transport.close()


async def aiohttp_load(url: str, wl: Workload) -> dict[str, Any]:
    """The earlier load generator (aiohttp), for comparison: it spends 1.5-6x the CPU per request of
    :func:`raw_load`, CPU that the server under test then lacks."""
    import aiohttp

    bodies = _bodies(wl)
    headers = {"Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=wl.clients, keepalive_timeout=300)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S)) as session:

        async def send(_: int, i: int) -> int:
            async with session.post(url + GEN_PATH, data=bodies[i], headers=headers) as r:
                body = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {body[:200]!r}")
                return _count_tokens(body, wl.stream)

        return await closed_loop(wl, send)


CLIENTS = {"raw": raw_load, "aiohttp": aiohttp_load}
