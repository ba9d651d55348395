"""tito's gRPC surface (``--grpc-port``) on a real engine: the same tokens and logprobs as HTTP, the same validation
and messages, the server and model metadata, Abort and drain. KV events, the smg gateway and SIGTERM:
test_grpc_events.py; keys: test_grpc_auth.py (smg sends none to gRPC workers).

Two replicas (tests/conftest.py): ``grpc_a`` (KV events) serves every test, ``grpc_b`` (the default server's gRPC
port: no KV events, no LoRA) the checks of vllm.Inference without LoRA.
"""

from __future__ import annotations

import io
import json
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from tests.grpc_client import Replica, admin_call, code_of, collect, gen_request, health_of, until
from tests.helpers import TIMING, metric_value
from tests.sidecar import stream_matches_http
from tests.streaming import GEN

pytestmark = pytest.mark.engine

PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 301, 302], [5, 6, 7, 8, 9, 10, 11, 12]]


def _http(r: Replica, body: dict[str, Any]) -> dict[str, Any]:
    with r.http() as c:
        resp = c.post(GEN, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _f32(xs: list[float]) -> list[float]:
    return [float(np.float32(x)) for x in xs]


# --------------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("replica", ["grpc_a", "grpc_b"], ids=["grpcio", "native"])
def test_greedy_tokens_and_logprobs_match_http(request: pytest.FixtureRequest, replica: str, stream: bool) -> None:
    """On both gRPC servers: grpc_a serves on grpcio's, grpc_b on the default (pygrpc-native's)."""
    grpc_a: Replica = request.getfixturevalue(replica)
    stub = grpc_a.stub()
    for ids in PROMPTS:
        http = _http(grpc_a, {"token_ids": ids, "sampling_params": {"temperature": 0, "max_tokens": 24,
                                                                     "ignore_eos": True, "logprobs": 3,
                                                                     "prompt_logprobs": 1}})
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


def test_max_tokens_past_the_context_generates_to_its_end(grpc_a: Replica) -> None:
    """As on HTTP (tests/test_generate.py): the tokens that fit, and "length"."""
    ids = [(7 * i) % 500 + 3 for i in range(500)]
    for stream in (False, True):
        got = collect(grpc_a.stub().Generate(gen_request(ids, 100, stream=stream, ignore_eos=True)))
        assert len(got["tokens"]) == 12 and got["finish"] == "length"


def test_a_slow_reader_gets_every_token_once_in_order_in_fewer_chunks(grpc_a: Replica) -> None:
    """smg's stream to a reader that falls behind (a 1 KiB flow-control window it does not drain): the tokens made
    while a write is held up come in one chunk when it completes; every token once, in order, with HTTP's logprobs."""
    ids, n = PROMPTS[2], 200
    choice = _http(grpc_a, {"token_ids": ids, "sampling_params": {"temperature": 0, "max_tokens": n,
                                                                  "ignore_eos": True, "logprobs": 3}})["choices"][0]
    window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]

    def generated() -> float:
        with grpc_a.http() as c:
            return metric_value(c.get("/metrics").text, "vllm:generation_tokens_total") or 0.0

    before = generated()
    with grpc.insecure_channel(grpc_a.target, options=window) as slow:
        stream = pb_grpc.VllmEngineStub(slow).Generate(gen_request(ids, n, stream=True, logprobs=3,
                                                                   ignore_eos=True), timeout=120)
        first = next(stream)
        until(lambda: generated() >= before + n, 60)  # the reader reads nothing until the engine is done
        got = collect([first, *stream])
    assert got["tokens"] == choice["token_ids"] and got["finish"] == "length"
    assert got["logprobs"] == _f32([e["logprob"] for e in choice["logprobs"]["content"]])
    assert 2 <= got["chunks"] < n // 2, got["chunks"]


def test_vllm_inference_prompt_logprobs_match_http(grpc_b: Replica) -> None:
    """vllm.Inference (the Dynamo sidecar's service) on the same port, on a replica without LoRA: the prompt's logprobs
    and ranks equal HTTP's (the LoRA sidecar replicas refuse prompt logprobs, test_sidecar_grpc.py)."""
    with httpx.Client(base_url=grpc_b.url, timeout=120) as http:
        for ids in PROMPTS[:2]:
            stream_matches_http(grpc_b.server, http, ids, prompt_logprobs=True, model="")


def test_n_samples_and_seeded_sampling_match_http(grpc_a: Replica) -> None:
    ids = PROMPTS[0]
    http = _http(grpc_a, {"token_ids": ids, "sampling_params": {"temperature": 1.0, "seed": 7, "max_tokens": 12, "n": 2,
                                                            "ignore_eos": True}})
    want = {c["index"]: c["token_ids"] for c in http["choices"]}
    req = gen_request(ids, 12, ignore_eos=True, n=2, seed=7)
    req.sampling_params.temperature = 1.0
    got: dict[int, list[int]] = {}
    for r in grpc_a.stub().Generate(req):
        got[r.complete.index] = list(r.complete.output_ids)
    assert got == want and len(got) == 2


# --------------------------------------------------------------------------------------------------- validation


BAD: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (case, proto fields, the HTTP body with the same meaning)
    ("out of vocabulary", {"ids": [1, 512]}, {"token_ids": [1, 512]}),
    ("prompt fills the context", {"ids": [1] * 512}, {"token_ids": [1] * 512}),
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
def test_bad_input_is_invalid_argument_with_the_http_message(grpc_a: Replica, case: str, proto: dict[str, Any],
                                                              body: dict[str, Any]) -> None:
    proto = dict(proto)
    ids = proto.pop("ids", [1, 2, 3])
    max_tokens = proto.pop("max_tokens", 4)
    http_body = {"token_ids": [1, 2, 3], **body}
    http_body["sampling_params"] = {"max_tokens": max_tokens, **body.get("sampling_params", {})}
    with grpc_a.http() as c:
        r = c.post(GEN, json=http_body)
    assert r.status_code == 400, r.text
    req = gen_request(ids, max_tokens, **proto)
    code, details = code_of(lambda: grpc_a.stub().Generate(req))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details == r.json()["error"]["message"]


def test_text_and_multimodal_input_are_refused_and_the_engine_keeps_serving(grpc_a: Replica) -> None:
    stub = grpc_a.stub()
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
    with grpc_a.http() as c:
        text = c.get("/metrics").text
    assert (metric_value(text, "tito_grpc_requests_total", {"method": "Generate", "code": "INVALID_ARGUMENT"})
            or 0) >= 3


# --------------------------------------------------------------------------------------------------- metadata


def test_server_and_model_info_carry_what_server_info_says(grpc_a: Replica) -> None:
    stub = grpc_a.stub()
    with grpc_a.http() as c:
        http = c.get("/server_info").json()
    info, call = stub.GetServerInfo.with_call(pb.GetServerInfoRequest())
    carried = json.loads(dict(call.trailing_metadata())["tito-server-info"])
    for key in ("model", "parallelism", "features"):
        assert carried[key] == http[key]
    assert carried["server"]["grpc_port"] == http["server"]["grpc_port"] == grpc_a.grpc_port
    assert http["server"]["grpc_server"] == "grpcio"  # as started (tests/conftest.py); the default is "native"
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


# --------------------------------------------------------------------------------------------------- abort, drain


@TIMING
def test_abort_ends_a_running_stream_with_its_partial_tokens(grpc_a: Replica) -> None:
    stub = grpc_a.stub()
    call = stub.Generate(gen_request([1, 2, 3, 4], 400, stream=True, request_id="grpc-abort-1", ignore_eos=True))
    first = next(call)
    assert len(first.chunk.token_ids) >= 1
    admin_call(grpc_a, "POST", "/pause", params={"mode": "keep"})  # frozen: only the abort can end it now
    try:
        stub.Abort(pb.AbortRequest(request_ids=["grpc-abort-1"]))
        got = collect(call)
    finally:
        admin_call(grpc_a, "POST", "/resume")
    tokens = list(first.chunk.token_ids) + got["tokens"]
    assert got["finish"] == "abort"
    assert 1 <= len(tokens) < 400
    until(lambda: health_of(grpc_a)["inflight"] == 0)


@TIMING
def test_abort_ends_a_running_unary_call(grpc_a: Replica) -> None:
    stub = grpc_a.stub()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(lambda: collect(stub.Generate(
            gen_request([1, 2, 3, 4], 400, request_id="grpc-abort-2", ignore_eos=True))))
        until(lambda: health_of(grpc_a)["inflight"] >= 1)  # admitted and counted, as an HTTP request is
        admin_call(grpc_a, "POST", "/pause", params={"mode": "keep"})
        try:
            stub.Abort(pb.AbortRequest(request_ids=["generate-tokens-grpc-abort-2"]))
            got = fut.result(60)
        finally:
            admin_call(grpc_a, "POST", "/resume")
    assert got["finish"] == "abort" and len(got["tokens"]) < 400
    assert got["completion_tokens"] == len(got["tokens"])


@TIMING
def test_drain_counts_grpc_requests_and_refuses_new_ones(grpc_a: Replica) -> None:
    stub = grpc_a.stub()
    health = health_pb2_grpc.HealthStub(grpc_a.channel())
    call = stub.Generate(gen_request([1, 2, 3, 4], 400, stream=True, request_id="grpc-drain", ignore_eos=True))
    next(call)
    admin_call(grpc_a, "POST", "/pause", params={"mode": "keep"})
    try:
        # The drain waits for the gRPC request as for an HTTP one: it is still running when the wait times out.
        drained = admin_call(grpc_a, "POST", "/drain", json={"timeout": 0.5}).json()
        assert drained["status"] == "timeout" and drained["still_running"] == 1, drained
        with grpc_a.http() as c:
            assert metric_value(c.get("/metrics").text, "tito_inflight_requests") == 1
        code, details = code_of(lambda: stub.Generate(gen_request([1, 2], 2)))
        assert code is grpc.StatusCode.UNAVAILABLE and "draining" in details
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        check = stub.HealthCheck(pb.HealthCheckRequest())
        assert not check.healthy and check.message == "draining"
    finally:
        admin_call(grpc_a, "POST", "/resume")
    got = collect(call)  # the admitted request finishes normally during the drain
    assert got["finish"] == "length"
    until(lambda: health_of(grpc_a)["inflight"] == 0)
    admin_call(grpc_a, "DELETE", "/drain")
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    assert len(collect(stub.Generate(gen_request([1, 2], 2, ignore_eos=True)))["tokens"]) == 2
