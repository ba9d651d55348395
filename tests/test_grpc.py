"""tito's gRPC surface (``--grpc-port``) on a real engine: the same tokens and logprobs as HTTP, the same admission,
validation and keys, Abort, drain and SIGTERM; and the real smg gateway serving ``/v1/completions`` through two
tito replicas over gRPC.

Two replicas for the module: ``a`` serves every test; ``b`` joins for the gateway test and is then stopped by the
SIGTERM test (last in the file). Keys are tested in test_grpc_auth.py (smg sends none to gRPC workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
import threading
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import common_pb2

from tests.grpc_client import Replica, code_of, collect, gen_request, start_replica, start_smg
from tests.helpers import TIMING, metric_value
from tests.sidecar import stream_matches_http
from tests.streaming import GEN, wait_for
from tests.sweep import fire, shapes

pytestmark = pytest.mark.engine

ENGINE = "vllm.grpc.engine.VllmEngine"
PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 301, 302], [5, 6, 7, 8, 9, 10, 11, 12]]
BLOCK = 32  # replica a's KV block size: a few blocks of prompt publish KV events


@pytest.fixture(scope="module")
def tok_model(tiny_model: Path) -> Path:
    """The embedded model ships its tokenizer (app/tiny/tokenizer.py): smg tokenizes with it. (A stand-in tokenizer
    written over it once declared an eos outside the vocabulary, and min_tokens killed replica a's engine.)"""
    return tiny_model


@pytest.fixture(scope="module")
def a(tok_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    # KV events on (SubscribeKvEvents); VLLM_HOST_IP: the publisher's free ports (--kv-events-port 0) on loopback.
    r = start_replica(tmp_path_factory, tok_model, "grpc-a", "--max-logprobs", "5", "--kv-events-port", "0",
                      "--block-size", str(BLOCK), env={"VLLM_HOST_IP": "127.0.0.1"})
    yield r
    r.server.kill()


@pytest.fixture(scope="module")
def b(tok_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    r = start_replica(tmp_path_factory, tok_model, "grpc-b", "--max-logprobs", "5", "--shutdown-timeout", "120")
    yield r
    r.server.kill()


def _http(r: Replica, body: dict[str, Any]) -> dict[str, Any]:
    with r.http() as c:
        resp = c.post(GEN, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _f32(xs: list[float]) -> list[float]:
    return [float(np.float32(x)) for x in xs]


# --------------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_greedy_tokens_and_logprobs_match_http(a: Replica, stream: bool) -> None:
    stub = a.stub()
    for ids in PROMPTS:
        http = _http(a, {"token_ids": ids, "sampling_params": {"temperature": 0, "max_tokens": 24, "ignore_eos": True,
                                                                "logprobs": 3, "prompt_logprobs": 1}})
        choice = http["choices"][0]
        got = collect(stub.Generate(gen_request(ids, 24, stream=stream, logprobs=3, prompt_logprobs=1,
                                                ignore_eos=True)))
        assert got["tokens"] == choice["token_ids"] and len(got["tokens"]) == 24
        assert got["finish"] == choice["finish_reason"] == "length"
        if stream:
            assert got["chunks"] >= 2  # really streamed
        content = choice["logprobs"]["content"]
        # The proto carries float32: the HTTP float rounded to float32 is the very same number.
        assert got["logprobs"] == _f32([e["logprob"] for e in content])
        assert [[t for t, _ in step] for step in got["top"]] == [[t["token_id"] for t in e["top_logprobs"]]
                                                                 for e in content]
        assert [_f32([v for _, v in step]) for step in got["top"]] == [
            _f32([t["logprob"] for t in e["top_logprobs"]]) for e in content]
        # Prompt logprobs: none for the first token, then the logprob of each prompt token.
        want = [None] + [float(np.float32(step[str(t)]["logprob"]))
                         for t, step in zip(ids[1:], http["prompt_logprobs"][1:], strict=True)]
        assert got["prompt_lp"] == want


def test_vllm_inference_prompt_logprobs_match_http(b: Replica) -> None:
    """vllm.Inference (the Dynamo sidecar's service) on the same port, on a replica without LoRA: the prompt's logprobs
    and ranks equal HTTP's (the LoRA sidecar replicas refuse prompt logprobs, test_sidecar_grpc.py)."""
    with httpx.Client(base_url=b.url, timeout=120) as http:
        for ids in PROMPTS[:2]:
            stream_matches_http(b.server, http, ids, prompt_logprobs=True, model="")


def test_n_samples_and_seeded_sampling_match_http(a: Replica) -> None:
    ids = PROMPTS[0]
    http = _http(a, {"token_ids": ids, "sampling_params": {"temperature": 1.0, "seed": 7, "max_tokens": 12, "n": 2,
                                                            "ignore_eos": True}})
    want = {c["index"]: c["token_ids"] for c in http["choices"]}
    req = gen_request(ids, 12, ignore_eos=True, n=2, seed=7)
    req.sampling_params.temperature = 1.0
    got: dict[int, list[int]] = {}
    for r in a.stub().Generate(req):
        got[r.complete.index] = list(r.complete.output_ids)
    assert got == want and len(got) == 2


# --------------------------------------------------------------------------------------------------- validation


BAD: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (case, proto fields, the HTTP body with the same meaning)
    ("out of vocabulary", {"ids": [1, 512]}, {"token_ids": [1, 512]}),
    ("prompt fills the context", {"ids": [1] * 512}, {"token_ids": [1] * 512}),
    ("max_tokens beyond the context", {"max_tokens": 600}, {"sampling_params": {"max_tokens": 600}}),
    ("stop strings without a tokenizer", {"stop": ["a"]}, {"sampling_params": {"stop": ["a"]}}),
    ("logprobs above --max-logprobs", {"logprobs": 6}, {"sampling_params": {"logprobs": 6}}),
    ("stop id out of vocabulary", {"stop_token_ids": [9999]}, {"sampling_params": {"stop_token_ids": [9999]}}),
    ("logit_bias out of vocabulary", {"logit_bias": {600: 1.0}}, {"sampling_params": {"logit_bias": {"600": 1.0}}}),
    ("n above max_num_seqs", {"n": 1000}, {"sampling_params": {"n": 1000}}),
    ("structured output without a tokenizer", {"regex": "a+"}, {"sampling_params": {"structured_outputs":
                                                                                      {"regex": "a+"}}}),
    ("empty prompt", {"ids": []}, {"token_ids": []}),
]


@pytest.mark.parametrize(("case", "proto", "body"), BAD, ids=[c for c, _, _ in BAD])
def test_bad_input_is_invalid_argument_with_the_http_message(a: Replica, case: str, proto: dict[str, Any],
                                                              body: dict[str, Any]) -> None:
    proto = dict(proto)
    ids = proto.pop("ids", [1, 2, 3])
    max_tokens = proto.pop("max_tokens", 4)
    http_body = {"token_ids": [1, 2, 3], **body}
    http_body["sampling_params"] = {"max_tokens": max_tokens, **body.get("sampling_params", {})}
    with a.http() as c:
        r = c.post(GEN, json=http_body)
    assert r.status_code == 400, r.text
    req = gen_request(ids, max_tokens, **proto)
    code, details = code_of(lambda: a.stub().Generate(req))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details == r.json()["error"]["message"]


def test_text_and_multimodal_input_are_refused_and_the_engine_keeps_serving(a: Replica) -> None:
    stub = a.stub()
    code, details = code_of(lambda: stub.Generate(pb.GenerateRequest(text="hello")))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "tokenizer" in details
    mm = gen_request([1, 2, 3], 4)
    mm.mm_inputs.im_token_id = 5
    code, details = code_of(lambda: stub.Generate(mm))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "multimodal" in details
    trunc = gen_request([1, 2, 3], 4, truncate_prompt_tokens=2)
    code, details = code_of(lambda: stub.Generate(trunc))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "truncate_prompt_tokens" in details
    assert len(collect(stub.Generate(gen_request([1, 2, 3], 4, ignore_eos=True)))["tokens"]) == 4
    with a.http() as c:
        text = c.get("/metrics").text
    assert (metric_value(text, "tito_grpc_requests_total", {"method": "Generate", "code": "INVALID_ARGUMENT"})
            or 0) >= 3


# --------------------------------------------------------------------------------------------------- metadata


def test_server_and_model_info_carry_what_server_info_says(a: Replica) -> None:
    stub = a.stub()
    with a.http() as c:
        http = c.get("/server_info").json()
    info, call = stub.GetServerInfo.with_call(pb.GetServerInfoRequest())
    carried = json.loads(dict(call.trailing_metadata())["tito-server-info"])
    for key in ("model", "parallelism", "features"):
        assert carried[key] == http[key]
    assert carried["server"]["grpc_port"] == http["server"]["grpc_port"] == a.grpc_port
    assert carried["state"]["ready"] is True and carried["state"]["draining"] is False
    assert info.data_parallel_size == http["parallelism"]["data_parallel_size"]
    assert info.max_num_seqs == http["model"]["max_num_seqs"]
    assert info.model_dtype == http["model"]["dtype"] and info.block_size > 0
    model = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert model.served_model_name == http["model"]["served_model_name"]
    assert model.max_context_length == http["model"]["max_model_len"]
    assert model.vocab_size == http["model"]["vocab_size"]
    assert list(model.eos_token_ids) == [2] and model.bos_token_id == 1
    loads = stub.GetLoads(pb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.loads[0].max_running_requests == http["model"]["max_num_seqs"]
    # The model dir has a tokenizer: GetTokenizer streams it as a zip whose digest is on the last chunk.
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    import hashlib

    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert "tokenizer.json" in zipfile.ZipFile(io.BytesIO(data)).namelist()


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


def test_kv_events_stream_the_prompts_blocks_and_resume_from_a_sequence(a: Replica, b: Replica) -> None:
    rng = np.random.default_rng(int(time.time()))
    stub = a.stub()
    sub = _Subscription(a)
    try:
        # The stream's ZMQ subscription joins asynchronously: one short request until the stream carries events.
        for _ in range(5):
            warm = [int(t) for t in rng.integers(3, 500, BLOCK + 1)]
            collect(stub.Generate(gen_request(warm, 1)))
            with contextlib.suppress(AssertionError):
                _until(lambda w=warm: _blocks(w)[0] in sub.stored(), timeout=10)
                break
        assert sub.batches, "no KV event reached the stream"
        prompt = [int(t) for t in rng.integers(3, 500, 3 * BLOCK + 5)]  # 3 full blocks and a partial one
        mark = len(sub.batches)
        got = collect(stub.Generate(gen_request(prompt, 4, ignore_eos=True)))
        assert len(got["tokens"]) == 4
        _until(lambda: all(blk in sub.stored() for blk in _blocks(prompt)), timeout=60)
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
        again = _Subscription(a, start=new[0].sequence_number)
        try:
            _until(lambda: len(again.batches) >= len(new), timeout=30)
            assert [_no_ids(x) for x in again.batches[:len(new)]] == [_no_ids(x) for x in new]
        finally:
            again.close()
    finally:
        sub.close()
    assert sub.error is not None and sub.error.code() is grpc.StatusCode.CANCELLED

    def cancelled() -> float:
        with a.http() as c:
            return metric_value(c.get("/metrics").text, "tito_grpc_requests_total",
                                {"method": "SubscribeKvEvents", "code": "CANCELLED"}) or 0.0

    _until(lambda: cancelled() >= 2, timeout=30)  # both server-side streams ended (their sockets closed)
    # A cursor beyond what the engine published (a subscriber from before an engine restart): refused at the
    # next batch, not skipped silently.
    ahead = a.stub().SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=10**9), timeout=120)
    ahead.initial_metadata()
    collect(stub.Generate(gen_request([int(t) for t in rng.integers(3, 500, BLOCK + 1)], 1)))
    code, details = code_of(lambda: list(ahead))
    assert code is grpc.StatusCode.OUT_OF_RANGE and "start_sequence_number 0" in details, details
    # Without --kv-events-port: said at once, naming the flag (smg then stops subscribing to that worker).
    t0 = time.monotonic()
    code, details = code_of(lambda: list(b.stub().SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())))
    assert code is grpc.StatusCode.UNIMPLEMENTED and "--kv-events-port" in details
    assert time.monotonic() - t0 < 10


def test_trainer_request_shapes_together_keep_the_engine_publishing(a: Replica) -> None:
    """Issue 31's sweep on the KV-events configuration, a subscriber reading along: the engine serves afterwards and
    published the sweep's blocks (the 200-token prompt fills whole blocks)."""
    sub = _Subscription(a)
    try:
        fire(a.url, shapes())
        _until(lambda: len(sub.stored()) > 0, timeout=30)
    finally:
        sub.close()
    assert sub.error is None or sub.error.code() is grpc.StatusCode.CANCELLED


# --------------------------------------------------------------------------------------------------- abort, drain


def _admin(r: Replica, method: str, path: str, **kw: Any) -> httpx.Response:
    with r.http() as c:
        resp = c.request(method, path, **kw)
    assert resp.status_code == 200, resp.text
    return resp


def _health(r: Replica) -> dict[str, Any]:
    with r.http() as c:
        return c.get("/health").json()


def _until(pred: Any, timeout: float = 60.0) -> None:
    asyncio.run(wait_for(lambda: _as_coro(pred), timeout))


async def _as_coro(pred: Any) -> Any:
    return pred()


@TIMING
def test_abort_ends_a_running_stream_with_its_partial_tokens(a: Replica) -> None:
    stub = a.stub()
    call = stub.Generate(gen_request([1, 2, 3, 4], 400, stream=True, request_id="grpc-abort-1", ignore_eos=True))
    first = next(call)
    assert len(first.chunk.token_ids) >= 1
    _admin(a, "POST", "/pause", params={"mode": "keep"})  # frozen: only the abort can end it now
    try:
        stub.Abort(pb.AbortRequest(request_ids=["grpc-abort-1"]))
        got = collect(call)
    finally:
        _admin(a, "POST", "/resume")
    tokens = list(first.chunk.token_ids) + got["tokens"]
    assert got["finish"] == "abort"
    assert 1 <= len(tokens) < 400
    _until(lambda: _health(a)["inflight"] == 0)


@TIMING
def test_abort_ends_a_running_unary_call(a: Replica) -> None:
    stub = a.stub()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(lambda: collect(stub.Generate(
            gen_request([1, 2, 3, 4], 400, request_id="grpc-abort-2", ignore_eos=True))))
        _until(lambda: _health(a)["inflight"] >= 1)  # admitted and counted, as an HTTP request is
        _admin(a, "POST", "/pause", params={"mode": "keep"})
        try:
            stub.Abort(pb.AbortRequest(request_ids=["generate-tokens-grpc-abort-2"]))
            got = fut.result(60)
        finally:
            _admin(a, "POST", "/resume")
    assert got["finish"] == "abort" and len(got["tokens"]) < 400
    assert got["completion_tokens"] == len(got["tokens"])


@TIMING
def test_drain_counts_grpc_requests_and_refuses_new_ones(a: Replica) -> None:
    stub = a.stub()
    health = health_pb2_grpc.HealthStub(a.channel())
    call = stub.Generate(gen_request([1, 2, 3, 4], 400, stream=True, request_id="grpc-drain", ignore_eos=True))
    next(call)
    _admin(a, "POST", "/pause", params={"mode": "keep"})
    try:
        # The drain waits for the gRPC request as for an HTTP one: it is still running when the wait times out.
        drained = _admin(a, "POST", "/drain", json={"timeout": 0.5}).json()
        assert drained["status"] == "timeout" and drained["still_running"] == 1, drained
        with a.http() as c:
            assert metric_value(c.get("/metrics").text, "tito_inflight_requests") == 1
        code, details = code_of(lambda: stub.Generate(gen_request([1, 2], 2)))
        assert code is grpc.StatusCode.UNAVAILABLE and "draining" in details
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        check = stub.HealthCheck(pb.HealthCheckRequest())
        assert not check.healthy and check.message == "draining"
    finally:
        _admin(a, "POST", "/resume")
    got = collect(call)  # the admitted request finishes normally during the drain
    assert got["finish"] == "length"
    _until(lambda: _health(a)["inflight"] == 0)
    _admin(a, "DELETE", "/drain")
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    assert len(collect(stub.Generate(gen_request([1, 2], 2, ignore_eos=True)))["tokens"]) == 2


# --------------------------------------------------------------------------------------------------- smg gateway


def test_smg_gateway_serves_completions_through_two_replicas(a: Replica, b: Replica, tok_model: Path,
                                                             tmp_path: Path) -> None:
    def generates(r: Replica) -> float:
        with r.http() as c:
            return metric_value(c.get("/metrics").text, "tito_grpc_requests_total",
                                {"method": "Generate", "code": "OK"}) or 0.0

    before = [generates(a), generates(b)]
    smg = start_smg([a, b], tok_model, tmp_path / "smg.log")
    try:
        words = ["the quick brown fox", "hello world", "token in token out", "a tiny model", "hello tito"]
        bodies = [{"model": str(tok_model), "prompt": f"{words[i % len(words)]} {i}", "max_tokens": 8,
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

        def applied() -> float:  # KV-event batches smg's index took from a's stream (b has none: UNIMPLEMENTED)
            text = httpx.get(smg.metrics_url, timeout=10).text  # type: ignore[attr-defined]
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("smg_kv_event_batches_total{") and '"applied"' in line)

        # A prompt of a few KV blocks on replica a (whichever replica smg picked above): a publishes its blocks on
        # the SubscribeKvEvents stream smg holds, and smg's index applies them.
        collect(a.stub().Generate(gen_request([int(t) for t in np.arange(3, 3 + 3 * BLOCK)], 2)))
        _until(lambda: applied() > 0, timeout=60)
    finally:
        smg.kill()
    after = [generates(a), generates(b)]
    served = [x - y for x, y in zip(after, before, strict=True)]
    served[0] -= 1  # the direct Generate on a
    assert sum(served) >= 36 and all(n > 0 for n in served), served


# --------------------------------------------------------------------------------------------------- SIGTERM (last)


@TIMING
def test_sigterm_lets_grpc_requests_finish_then_exits_0(b: Replica) -> None:
    stub = b.stub()
    n, max_tokens = 4, 64
    # Frozen from the start (admitted and counted, no step runs): none can finish before the checks below.
    _admin(b, "POST", "/pause", params={"mode": "keep"})
    calls = [stub.Generate(gen_request([1, 2, 3, 4 + i], max_tokens, stream=True, request_id=f"term-{i}",
                                       ignore_eos=True)) for i in range(n)]
    results: list[dict[str, Any]] = [{} for _ in range(n)]

    def read(i: int) -> None:
        results[i] = collect(calls[i])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    _until(lambda: _health(b)["inflight"] == n)
    b.server.signal(signal.SIGTERM)
    _until(lambda: _health(b)["state"] == "shutting_down")
    code, details = code_of(lambda: stub.Generate(gen_request([1, 2], 2)))
    assert code is grpc.StatusCode.UNAVAILABLE and "shutting down" in details
    health = health_pb2_grpc.HealthStub(b.channel())
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    _admin(b, "POST", "/resume")
    for t in threads:
        t.join(120)
    for res in results:
        assert res["finish"] == "length" and len(res["tokens"]) == max_tokens, res
    assert b.server.proc is not None
    assert b.server.proc.wait(120) == 0, b.server.log_tail()
    log = b.server.log_text()
    assert "0 aborted" in log and "gRPC server stopped" in log
    assert log.index("gRPC server stopped") < log.index("engine shut down")
