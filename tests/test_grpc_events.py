"""tito's gRPC surface beyond one request: KV events streamed and resumed from a sequence number, the trainers'
request shapes together, the real smg gateway serving ``/v1/completions`` through two tito replicas over gRPC, and
SIGTERM letting gRPC requests finish.

The replicas ``grpc_a`` and ``grpc_b`` of test_grpc.py (tests/conftest.py: ``grpc_b`` is the default server's gRPC
port); the SIGTERM test ends that server (it runs after the last other test using the default server).
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from tests.conftest import GRPC_BLOCK as BLOCK
from tests.grpc_client import Replica, admin_call, code_of, collect, gen_request, health_of, start_smg, until
from tests.helpers import TIMING, ServerProcess, metric_value
from tests.sweep import fire, shapes

pytestmark = pytest.mark.engine

# --------------------------------------------------------------------------------------------------- KV events


class _Subscription:
    """A SubscribeKvEvents call read by a thread into ``batches``."""

    def __init__(self, r: Replica, start: int = 0) -> None:
        self.call = r.stub().SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=start))
        self.call.initial_metadata()  # the headers come at once, before any event
        self.batches: list[common_pb2.KvEventBatch] = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.batches.append(batch)
        except grpc.RpcError as e:
            self.error = e

    def stored(self) -> list[list[int]]:
        """The token ids of every stored block, in order."""
        return [list(b.token_ids) for x in list(self.batches) for e in x.events if e.HasField("stored")
                for b in e.stored.blocks]

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(30)
        assert not self.thread.is_alive()


def _no_ids(batch: common_pb2.KvEventBatch) -> common_pb2.KvEventBatch:
    """The batch without its event ids (each stream numbers its events from 1)."""
    out = common_pb2.KvEventBatch()
    out.CopyFrom(batch)
    for e in out.events:
        e.event_id = 0
    return out


def _blocks(ids: list[int]) -> list[list[int]]:
    return [ids[i:i + BLOCK] for i in range(0, len(ids) - len(ids) % BLOCK, BLOCK)]


def test_kv_events_stream_the_prompts_blocks_and_resume_from_a_sequence(grpc_a: Replica, grpc_b: Replica) -> None:
    rng = np.random.default_rng(int(time.time()))
    stub = grpc_a.stub()
    sub = _Subscription(grpc_a)
    try:
        # The stream's ZMQ subscription joins asynchronously: one short request until the stream carries events.
        for _ in range(5):
            warm = [int(t) for t in rng.integers(3, 500, BLOCK + 1)]
            collect(stub.Generate(gen_request(warm, 1)))
            with contextlib.suppress(AssertionError):
                until(lambda w=warm: _blocks(w)[0] in sub.stored(), timeout=10)
                break
        assert sub.batches, "no KV event reached the stream"
        prompt = [int(t) for t in rng.integers(3, 500, 3 * BLOCK + 5)]  # 3 full blocks and a partial one
        mark = len(sub.batches)
        got = collect(stub.Generate(gen_request(prompt, 4, ignore_eos=True)))
        assert len(got["tokens"]) == 4
        until(lambda: all(blk in sub.stored() for blk in _blocks(prompt)), timeout=60)
        new = sub.batches[mark:]
        stored = [e.stored for x in new for e in x.events if e.HasField("stored")]
        blocks = [blk for st in stored for blk in st.blocks]
        tokens = [list(blk.token_ids) for blk in blocks]
        i = tokens.index(_blocks(prompt)[0])
        assert tokens[i:i + 3] == _blocks(prompt)  # the prompt's full blocks, in order; not its partial tail
        assert all(blk.block_size == BLOCK for blk in blocks) and all(x.dp_rank == 0 for x in new)
        # The chain: the first block has no parent; a store that starts at a later block names the block before it.
        chain = [blk.block_hash for blk in blocks[i:i + 3]]
        for st in stored:
            if st.blocks[0].block_hash in chain:
                k = chain.index(st.blocks[0].block_hash)
                assert st.parent_block_hash == chain[k - 1] if k else not st.HasField("parent_block_hash")
        seqs = [x.sequence_number for x in sub.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # the publisher's numbers, consecutive
        # Resuming from a sequence replays the same batches from the engine's buffer, then goes on live.
        again = _Subscription(grpc_a, start=new[0].sequence_number)
        try:
            until(lambda: len(again.batches) >= len(new), timeout=30)
            assert [_no_ids(x) for x in again.batches[:len(new)]] == [_no_ids(x) for x in new]
        finally:
            again.close()
    finally:
        sub.close()
    assert sub.error is not None and sub.error.code() is grpc.StatusCode.CANCELLED

    def cancelled() -> float:
        with grpc_a.http() as c:
            return metric_value(c.get("/metrics").text, "tito_grpc_requests_total",
                                {"method": "SubscribeKvEvents", "code": "CANCELLED"}) or 0.0

    until(lambda: cancelled() >= 2, timeout=30)  # both server-side streams ended (their sockets closed)
    # A cursor beyond what the engine published (a subscriber from before an engine restart): refused at the
    # next batch, not skipped silently.
    ahead = grpc_a.stub().SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=10**9),
                                            timeout=120)
    ahead.initial_metadata()
    collect(stub.Generate(gen_request([int(t) for t in rng.integers(3, 500, BLOCK + 1)], 1)))
    code, details = code_of(lambda: list(ahead))
    assert code is grpc.StatusCode.OUT_OF_RANGE and "start_sequence_number 0" in details, details
    # Without --kv-events-port: said at once, naming the flag (smg then stops subscribing to that worker).
    t0 = time.monotonic()
    code, details = code_of(lambda: list(grpc_b.stub().SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())))
    assert code is grpc.StatusCode.UNIMPLEMENTED and "--kv-events-port" in details
    assert time.monotonic() - t0 < 10


def test_trainer_request_shapes_together_keep_the_engine_publishing(grpc_a: Replica) -> None:
    """The request-shape sweep on the KV-events configuration, a subscriber reading along: the engine serves after and
    published the sweep's blocks (the 200-token prompt fills whole blocks)."""
    sub = _Subscription(grpc_a)
    try:
        fire(grpc_a.url, shapes())
        until(lambda: len(sub.stored()) > 0, timeout=30)
    finally:
        sub.close()
    assert sub.error is None or sub.error.code() is grpc.StatusCode.CANCELLED


# --------------------------------------------------------------------------------------------------- smg gateway


def test_smg_gateway_serves_completions_through_two_replicas(grpc_a: Replica, grpc_b: Replica, tiny_model: Path,
                                                             tmp_path: Path) -> None:
    def generates(r: Replica) -> float:
        with r.http() as c:
            return metric_value(c.get("/metrics").text, "tito_grpc_requests_total",
                                {"method": "Generate", "code": "OK"}) or 0.0

    before = [generates(grpc_a), generates(grpc_b)]
    # The embedded model ships its tokenizer (app/tiny/tokenizer.py): smg tokenizes with it.
    smg = start_smg([grpc_a, grpc_b], tiny_model, tmp_path / "smg.log")
    try:
        words = ["the quick brown fox", "hello world", "token in token out", "a tiny model", "hello tito"]
        bodies = [{"model": str(tiny_model), "prompt": f"{words[i % len(words)]} {i}", "max_tokens": 8,
                   "temperature": 0, "stream": i % 4 == 3} for i in range(36)]

        def one(body: dict[str, Any]) -> tuple[int, str]:
            with httpx.Client(base_url=smg.url, timeout=120.0) as c:
                r = c.post("/v1/completions", json=body)
                return r.status_code, r.text

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(one, bodies))
        errors = [(s, t[:300]) for s, t in results if s != 200]
        assert errors == [], errors
        for (_, text), body in zip(results, bodies, strict=True):
            if body["stream"]:
                assert "data:" in text and "[DONE]" in text
            else:
                out = json.loads(text)
                assert out["choices"][0]["finish_reason"] in ("length", "stop")
                assert out["usage"]["completion_tokens"] >= 1

        def applied() -> float:  # KV-event batches smg's index took from grpc_a's stream (grpc_b has none)
            text = httpx.get(smg.metrics_url, timeout=10).text  # type: ignore[attr-defined]
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("smg_kv_event_batches_total{") and '"applied"' in line)

        # A prompt of a few KV blocks on replica a (whichever replica smg picked above): a publishes its blocks on
        # the SubscribeKvEvents stream smg holds, and smg's index applies them.
        collect(grpc_a.stub().Generate(gen_request([int(t) for t in np.arange(3, 3 + 3 * BLOCK)], 2)))
        until(lambda: applied() > 0, timeout=60)
    finally:
        smg.kill()
    after = [generates(grpc_a), generates(grpc_b)]
    served = [x - y for x, y in zip(after, before, strict=True)]
    served[0] -= 1  # the direct Generate on a
    assert sum(served) >= 36 and all(n > 0 for n in served), served


# --------------------------------------------------------------------------------------------------- SIGTERM (last)


@TIMING
@pytest.mark.ends_server("tito")  # grpc_b: the default server's gRPC port
def test_sigterm_lets_grpc_requests_finish_then_exits_0(ending_server: ServerProcess) -> None:
    assert ending_server.grpc_port is not None
    b = Replica(ending_server, ending_server.grpc_port)
    stub = b.stub()
    n, max_tokens = 4, 64
    # Frozen from the start (admitted and counted, no step runs): none can finish before the checks below.
    admin_call(b, "POST", "/pause", params={"mode": "keep"})
    calls = [stub.Generate(gen_request([1, 2, 3, 4 + i], max_tokens, stream=True, request_id=f"term-{i}",
                                       ignore_eos=True)) for i in range(n)]
    results: list[dict[str, Any]] = [{} for _ in range(n)]

    def read(i: int) -> None:
        results[i] = collect(calls[i])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    until(lambda: health_of(b)["inflight"] == n)
    b.server.signal(signal.SIGTERM)
    until(lambda: health_of(b)["state"] == "shutting_down")
    code, details = code_of(lambda: stub.Generate(gen_request([1, 2], 2)))
    assert code is grpc.StatusCode.UNAVAILABLE and "shutting down" in details
    health = health_pb2_grpc.HealthStub(b.channel())
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    admin_call(b, "POST", "/resume")
    for t in threads:
        t.join(120)
    for res in results:
        assert res["finish"] == "length" and len(res["tokens"]) == max_tokens, res
    assert b.server.proc is not None
    assert b.server.proc.wait(120) == 0, b.server.log_tail()
    log = b.server.log_text()
    assert "0 aborted" in log and "gRPC server stopped" in log
    assert log.index("gRPC server stopped") < log.index("engine shut down")
