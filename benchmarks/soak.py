"""Soak: weight updates under load, and an audit of every answer.

While ``--streams`` clients each keep one streamed generate request in flight (closed loop, random prompt and
``max_tokens``, EOS ignored), the updater runs ``--updates`` cycles of ``POST /pause?mode=keep`` →
``POST /update_weights`` (alternating two checkpoints, each update its own version) → ``POST /resume``, each after the
clients have finished a batch of answers since the last one. Then the clients stop and every answer is audited:

    requests      answers received
    lost          no answer: a non-200 status, a transport error, an error event, or a stream without [DONE]
    short         fewer tokens than max_tokens, or a finish_reason other than "length"
    spans_bad     weight_versions spans that do not cover the answer contiguously from 0 to its last token, or name
                  a version that was never loaded, or go back to an older version
    failed_updates  a pause, update or resume that did not answer 200

Target: 0 lost, 0 short, 0 spans_bad, 0 failed_updates (exit code 1 otherwise).

Every request carries its own ``seed`` (the case that used to crash vLLM's EngineCore on CPU during an update: "CPU
Generator does not use offset"; tito now starts vLLM with chunked prefill off on CPU, see the docs); ``--no-seed`` sends
none.

    python -m benchmarks soak                               # 20 updates under 256 streams on the tiny model
    python -m benchmarks soak --updates 4 --streams 32      # a short run
    python -m benchmarks soak --url http://127.0.0.1:8000 --checkpoints DIR_A,DIR_B   # against a running server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.clients import GEN_PATH, _Conn, sse_events  # the lean HTTP/1.1 client of the benchmarks
from benchmarks.servers import MAX_MODEL_LEN, start


@dataclass
class Report:
    requests: int = 0
    ok: int = 0
    lost: int = 0
    short: int = 0
    spans_bad: int = 0
    mixed_versions: int = 0  # answers whose tokens came from more than one weight version (expected under updates)
    updates: int = 0
    failed_updates: int = 0
    update_cycle_s_p50: float = 0.0
    update_cycle_s_max: float = 0.0
    wall_s: float = 0.0
    seeded: bool = False
    samples: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.lost or self.short or self.spans_bad or self.failed_updates)


def parse_sse(body: bytes) -> tuple[list[int], str | None, list[dict[str, Any]] | None, list[Any], bool]:
    """Tokens, last finish_reason, the weight_versions spans (final chunk), error events, and whether [DONE] came."""
    tokens: list[int] = []
    finish: str | None = None
    spans: list[dict[str, Any]] | None = None
    errors: list[Any] = []
    events, done = sse_events(body)
    for ev in events:
        if "error" in ev:
            errors.append(ev["error"])
            continue
        for ch in ev.get("choices") or ():
            tokens += ch.get("token_ids") or ()
            finish = ch.get("finish_reason") or finish
            spans = ch.get("weight_versions") or spans
    return tokens, finish, spans, errors, done


def spans_problem(spans: list[dict[str, Any]] | None, n: int, order: list[str]) -> str | None:
    """Why ``spans`` do not describe ``n`` tokens from versions loaded in ``order`` (None when they do)."""
    if n == 0:
        return None
    if not spans:
        return "no weight_versions"
    pos, last = 0, -1
    for s in spans:
        if s["start"] != pos or s["end"] <= s["start"]:
            return f"not contiguous at token {pos}: {spans}"
        if s["version"] not in order:
            return f"unknown version {s['version']!r}"
        idx = order.index(s["version"])
        if idx < last:
            return f"goes back to an older version: {spans}"
        pos, last = s["end"], idx
    return None if pos == n else f"spans end at {pos}, answer has {n} tokens"


async def soak(url: str, checkpoints: list[str], updates: int, streams: int, *, seed_requests: bool = True,
               batch: int | None = None, max_tokens: int = 128, timeout: float = 1800.0,
               initial_version: str | None = None) -> Report:
    """Run the soak against a server at ``url`` whose allowed weight roots hold ``checkpoints``."""
    import httpx

    rep = Report(seeded=seed_requests)
    host, _, port = url.removeprefix("http://").partition(":")
    head = (f"POST {GEN_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            "Content-Length: ").encode()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    answered = 0
    order: list[str] = []
    rng = random.Random(0)

    async with httpx.AsyncClient(base_url=url, timeout=600.0) as admin:
        order.append(initial_version or (await admin.get("/server_info")).json()["state"]["weight_version"])

        def sample(msg: str) -> None:
            if len(rep.samples) < 20:
                rep.samples.append(msg)

        async def client(c: int) -> None:
            nonlocal answered
            conn: _Conn | None = None
            i = 0
            while not stop.is_set():
                i += 1
                want = rng.randint(16, max_tokens)
                sp: dict[str, Any] = {"max_tokens": want, "temperature": 1.0, "ignore_eos": True}
                if seed_requests:
                    sp["seed"] = c * 100003 + i
                prompt = [rng.randrange(1, 400) for _ in range(rng.randint(4, 32))]
                body = json.dumps({"token_ids": prompt, "stream": True, "sampling_params": sp}).encode()
                rep.requests += 1
                try:
                    if conn is None or conn.transport is None:
                        _, conn = await loop.create_connection(_Conn, host, int(port))
                    status, raw = await conn.request(head, body)
                except Exception as e:  # noqa: BLE001 - a lost answer is counted, never fatal
                    conn = None
                    rep.lost += 1
                    sample(f"transport: {type(e).__name__}: {e}")
                    continue
                answered += 1
                if status != 200:
                    rep.lost += 1
                    sample(f"HTTP {status}: {raw[:200]!r}")
                    continue
                tokens, finish, spans, errors, done = parse_sse(raw)
                if errors or not done:
                    rep.lost += 1
                    sample(f"stream: errors={errors} done={done}")
                    continue
                if len(tokens) != want or finish != "length":
                    rep.short += 1
                    sample(f"short: {len(tokens)} of {want} tokens, finish={finish}")
                    continue
                problem = spans_problem(spans, len(tokens), order)
                if problem:
                    rep.spans_bad += 1
                    sample(f"spans: {problem}")
                    continue
                rep.ok += 1
                if spans and len(spans) > 1:
                    rep.mixed_versions += 1
            if conn is not None and conn.transport is not None:
                conn.transport.close()

        async def call(method: str, path: str, **kw: Any) -> bool:
            try:
                r = await admin.request(method, path, **kw)
            except httpx.HTTPError as e:
                rep.failed_updates += 1
                sample(f"{path}: {type(e).__name__}: {e}")
                return False
            if r.status_code != 200:
                rep.failed_updates += 1
                sample(f"{path}: HTTP {r.status_code}: {r.text[:200]}")
                return False
            return True

        async def updater() -> None:
            every = batch or max(streams // 2, 8)
            cycles: list[float] = []
            for k in range(1, updates + 1):
                target = answered + every
                while answered < target:
                    await asyncio.sleep(0.05)
                version = f"soak-{k}"
                t0 = time.monotonic()
                # The version is known before any token can carry it (the update sets it while paused).
                order.append(version)
                if await call("POST", "/pause", params={"mode": "keep"}):
                    await call("POST", "/update_weights",
                               json={"weight_dir": checkpoints[k % len(checkpoints)], "weight_version": version})
                    await call("POST", "/resume")
                rep.updates += 1
                cycles.append(time.monotonic() - t0)
                print(f"update {k}/{updates}: {version} in {cycles[-1]:.2f}s, {answered} answers so far",
                      file=sys.stderr, flush=True)
            target = answered + every  # let the last version serve a batch too
            while answered < target:
                await asyncio.sleep(0.05)
            if cycles:
                rep.update_cycle_s_p50 = statistics.median(cycles)
                rep.update_cycle_s_max = max(cycles)
            stop.set()

        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(client(c)) for c in range(streams)]
        try:
            await asyncio.wait_for(updater(), timeout)
            await asyncio.wait_for(asyncio.gather(*tasks), 600)
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
        rep.wall_s = time.monotonic() - t0
    return rep


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128, help="Each request asks for 16..N tokens (default 128).")
    p.add_argument("--no-seed", action="store_true", help="Send no seed (default: a seed per request).")
    p.add_argument("--url", default=None, help="A running tito (default: start one on the tiny model).")
    p.add_argument("--checkpoints", default=None,
                   help="Two comma-separated checkpoint directories to alternate (default: two tiny models).")
    p.add_argument("--out", default="results", help="Folder for soak.json and the server log (default results/).")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)

    out = Path(ns.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if ns.checkpoints:
        ckpts = [str(Path(x).resolve()) for x in ns.checkpoints.split(",") if x]
    else:
        from app.tiny.model import make_tiny_model

        ckpts = [str(make_tiny_model(out / "soak" / "ckpt-a")), str(make_tiny_model(out / "soak" / "ckpt-b", seed=1))]
    server = None
    url = ns.url
    if url is None:
        from tests.helpers import engine_env, free_port, tito_cmd

        port = free_port()
        cmd = tito_cmd(ckpts[0], port, "--max-model-len", str(MAX_MODEL_LEN), "--allowed-weight-root", str(out))
        server = start(cmd, port, out / "soak-server.log", engine_env())
        url = server.url
    try:
        rep = asyncio.run(soak(url, ckpts, ns.updates, ns.streams, seed_requests=not ns.no_seed,
                               max_tokens=ns.max_tokens))
    finally:
        if server is not None:
            server.stop()
    doc = {"updates_requested": ns.updates, "streams": ns.streams, **asdict(rep), "clean": rep.clean}
    (out / "soak.json").write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc, indent=2))
    return 0 if rep.clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
