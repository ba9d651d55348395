"""vLLM's native ``vllm.Control`` + ``vllm.Inference`` on tito's gRPC server, called as Dynamo's sidecar calls them,
against a real engine (the shared ``sidecar_a`` replica): truthful, stable discovery; the stream shape the sidecar
reads, with the same tokens and logprobs as HTTP and the tokenizer's text; bad input refused before the engine;
Abort; control, weight-version and LoRA calls visible in tito's own HTTP state; health following tito's state."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file
from tokenizers import Tokenizer

from app.grpc.proto import vllm_control_pb2 as cpb
from app.grpc.proto import vllm_inference_pb2 as ipb
from app.grpc.proto import vllm_inference_pb2_grpc as ipb_grpc
from tests.helpers import ServerProcess, metric_value, restore_server
from tests.sidecar import (
    FINISH,
    MODEL,
    channel,
    code_of,
    control,
    gen,
    grpc_port,
    inference,
    joined,
    model_dir,
    stream_matches_http,
    wait_for,
)
from tests.streaming import GEN

pytestmark = pytest.mark.engine

PROMPTS = [[17, 250, 33, 401, 9, 77], [1, 300, 301, 302]]
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def a(sidecar_a: ServerProcess) -> Iterator[ServerProcess]:
    yield sidecar_a
    restore_server(sidecar_a.url)


@pytest.fixture(scope="module")
def http(a: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=a.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(a: ServerProcess) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir(a) / "tokenizer.json"))


def _http_greedy(http: httpx.Client, ids: list[int], n: int, **sp: Any) -> dict[str, Any]:
    r = http.post(GEN, json={"token_ids": ids, "sampling_params": {"max_tokens": n, "temperature": 0,
                                                                   "ignore_eos": True, **sp}})
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------------------------------------ discovery


def test_server_and_model_info_are_truthful_and_identical_on_every_connection(a: ServerProcess,
                                                                             http: httpx.Client) -> None:
    # A new channel each time, as the sidecar's connection pool opens them.
    answers = [(control(a).GetServerInfo(cpb.GetServerInfoRequest()),
                control(a).GetModelInfo(cpb.GetModelInfoRequest())) for _ in range(3)]
    assert all(x == answers[0] for x in answers)
    server, model = answers[0]
    info = http.get("/server_info").json()
    assert server.api_version == "vllm" and server.engine_version == info["server"]["vllm_version"]
    assert info["server"]["grpc_server"] == "native"  # the default: what the sidecar talks to in every test here
    assert server.instance_id
    p = server.parallelism
    assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.data_parallel_size) == (1, 1, 1)
    assert p.data_parallel_rank == 0
    assert p.world_size == http.get("/get_world_size").json()["world_size"] == 1
    assert p.HasField("data_parallel_size_local") and p.data_parallel_size_local == 1
    assert server.max_model_len == info["model"]["max_model_len"] == 512
    assert server.kv_block_size == server.effective_attention_block_size == info["model"]["kv_block_size"] == 32
    assert server.total_kv_blocks == info["model"]["num_kv_blocks"] == 512
    assert server.max_running_requests == info["model"]["max_num_seqs"] and server.max_batched_tokens >= 512
    assert server.max_loras == info["features"]["max_loras"] == 2
    assert server.HasField("rl_capabilities") and not server.rl_capabilities.weight_transfer_enabled
    assert not server.rl_capabilities.sleep_mode_enabled
    # The sidecar reads the model's files from model_id on its own disk: an absolute path with a tokenizer.
    assert model.model_id == os.path.abspath(info["model"]["path"]) and os.path.isabs(model.model_id)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(model.model_id))
    assert model.served_model_name == MODEL and model.supports_token_ids_input and model.supports_lora
    assert not model.supports_text_input and not model.reasoning_parser and not model.tool_call_parser


def test_kv_event_sources_list_the_engines_publisher(a: ServerProcess, http: httpx.Client) -> None:
    sources = control(a).GetKvEventSources(cpb.GetKvEventSourcesRequest()).sources
    assert len(sources) == 1
    s = sources[0]
    assert s.transport == "zmq" and s.HasField("data_parallel_rank") and s.data_parallel_rank == 0
    assert s.endpoint == http.get("/server_info").json()["features"]["kv_events"]["0"]
    assert s.endpoint.startswith("tcp://127.0.0.1:") and s.replay_endpoint.startswith("tcp://127.0.0.1:")


def test_health_statuses_follow_titos_state(a: ServerProcess, http: httpx.Client) -> None:
    health = health_pb2_grpc.HealthStub(channel(a))
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    services = ("vllm.Control", "vllm.Inference")
    assert [health.Check(health_pb2.HealthCheckRequest(service=s)).status for s in services] == [serving] * 2
    assert http.post("/drain", json={"timeout": 5}).status_code == 200
    try:
        assert [health.Check(health_pb2.HealthCheckRequest(service=s)).status for s in services] == [not_serving] * 2
        code, details = code_of(lambda: inference(a).GenerateStream(gen([1, 2, 3], 2)))
        assert code is grpc.StatusCode.UNAVAILABLE and "draining" in details
    finally:
        http.delete("/drain")
    assert [health.Check(health_pb2.HealthCheckRequest(service=s)).status for s in services] == [serving] * 2


# ------------------------------------------------------------------------------------------------ generation


def test_stream_has_the_sidecars_shape_and_https_tokens_logprobs_and_text(a: ServerProcess,
                                                                         http: httpx.Client) -> None:
    for ids in PROMPTS:
        stream_matches_http(a, http, ids, prompt_logprobs=False)
    # This replica runs --enable-lora: its prompt logprobs (each prompt row through the request's adapter, none here)
    # are served over gRPC as over HTTP.
    stream_matches_http(a, http, PROMPTS[0], prompt_logprobs=True)


def test_kv_transfer_params_are_threaded_as_http_threads_them(a: ServerProcess, http: httpx.Client) -> None:
    """No KV connector on this server: the request's params come back in the finish info, as HTTP echoes them."""
    params = {"do_remote_decode": False, "remote_host": "10.0.0.7", "remote_port": "5600"}
    req = gen(PROMPTS[1], 4)
    req.kv.kv_transfer_params.update(params)
    got = joined(inference(a).GenerateStream(req))
    assert json_format.MessageToDict(got["finish"].kv_transfer_params) == params
    body = {"token_ids": PROMPTS[1], "kv_transfer_params": params, "sampling_params": {"max_tokens": 4,
                                                                                      "temperature": 0}}
    assert http.post(GEN, json=body).json()["kv_transfer_params"] == params


def test_stop_token_and_stop_string_end_a_sequence_with_stop(a: ServerProcess, http: httpx.Client,
                                                             tok: Tokenizer) -> None:
    ids = PROMPTS[0]
    tokens = _http_greedy(http, ids, 16)["choices"][0]["token_ids"]
    stop_id = tokens[5]
    got = joined(inference(a).GenerateStream(gen(ids, 16, stopping=ipb.StoppingCriteria(
        max_new_tokens=16, stop_token_ids=[stop_id], ignore_eos=True))))
    assert got["tokens"] == tokens[:tokens.index(stop_id) + 1]
    assert got["finish"].finish_reason == FINISH.STOP and got["finish"].stop_token_id == stop_id
    # A stop string: the text ends before it, the tokens with the one that completed it, the engine stops.
    text = tok.decode(tokens)
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].isprintable() and
                text[i:i + 2].strip() and text.index(text[i:i + 2]) == i)
    for include in (False, True):
        got = joined(inference(a).GenerateStream(gen(ids, 16, stopping=ipb.StoppingCriteria(
            max_new_tokens=16, stop_strings=[stop], include_stop_strings=include, ignore_eos=True))))
        cut = text.index(stop) + (len(stop) if include else 0)
        assert got["text"] == text[:cut]
        assert got["finish"].finish_reason == FINISH.STOP and got["finish"].stop_string == stop
        assert got["finish"].num_output_tokens == len(got["tokens"]) < 16
        assert got["tokens"] == tokens[:len(got["tokens"])] and stop in tok.decode(got["tokens"])
    wait_for(lambda: http.get("/health").json()["inflight"] == 0, 10, "nothing in flight")


def _prompt_tokens(http: httpx.Client) -> float:
    return metric_value(http.get("/metrics").text, "vllm:prompt_tokens_total") or 0.0


def test_a_slow_reader_gets_every_token_once_in_order_in_fewer_messages(a: ServerProcess, http: httpx.Client,
                                                                     tok: Tokenizer) -> None:
    """A reader that falls behind (a 1 KiB flow-control window it does not drain) holds up the stream's writes; what
    the engine makes meanwhile goes out as one multi-token message when the write completes: the same tokens,
    logprobs, text and finish as HTTP's, each token once and in order, in fewer messages than tokens."""
    ids, n = PROMPTS[1], 200
    choice = _http_greedy(http, ids, n, logprobs=2)["choices"][0]
    window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    slow = grpc.insecure_channel(f"127.0.0.1:{grpc_port(a)}", options=window)
    before = _generated(http)
    with slow:
        stream = ipb_grpc.InferenceStub(slow).GenerateStream(gen(ids, n, logprobs=2), timeout=120)
        first = next(stream)
        # The reader stops reading until the engine has made every token of the request.
        wait_for(lambda: _generated(http) >= before + n, 60, "the engine to finish the request")
        messages = [first, *stream]
    got = joined(messages)
    assert got["tokens"] == choice["token_ids"]
    assert got["logprobs"] == pytest.approx([e["logprob"] for e in choice["logprobs"]["content"]], abs=1e-5)
    assert got["text"] == tok.decode(got["tokens"]).removesuffix("\ufffd")
    assert got["finish"].finish_reason == FINISH.LENGTH and got["finish"].num_output_tokens == n
    sizes = [m.outputs.num_tokens for m in messages]
    assert sum(sizes) == n and got["messages"] < n // 2 and max(sizes) > 1, sizes


def _generated(http: httpx.Client) -> float:
    return metric_value(http.get("/metrics").text, "vllm:generation_tokens_total") or 0.0


@pytest.mark.parametrize("req, md, code", [
    (gen([5, 100000, 6], 4), None, INVALID),
    (gen([7] * 600, 4), None, INVALID),
    (gen([1, 2, 3], 4, lora_name="no-such-adapter"), None, grpc.StatusCode.NOT_FOUND),
    (ipb.GenerateRequest(model="other-model", token_ids=ipb.TokenIds(ids=[1, 2])), None, grpc.StatusCode.NOT_FOUND),
    (ipb.GenerateRequest(text="Hello"), None, INVALID),
    (gen([1, 2, 3], 4), (("x-data-parallel-rank", "1"),), INVALID),
    (gen([1, 2, 3], 4), (("x-data-parallel-rank", "zero"),), INVALID),
    (gen([1, 2, 3], 4, logprobs=50), None, INVALID),
    (gen([1, 2, 3], 4, priority=3), None, INVALID),
], ids=["out of vocabulary", "too long", "unknown adapter", "unknown model",
        "text prompt", "dp rank out of range", "dp rank not a number", "too many logprobs", "priority under fcfs"])
def test_bad_input_is_refused_before_the_engine(a: ServerProcess, http: httpx.Client, req: ipb.GenerateRequest,
                                                md: Any, code: grpc.StatusCode) -> None:
    before = _prompt_tokens(http)
    got, details = code_of(lambda: inference(a).GenerateStream(req, metadata=md))
    assert got is code and details
    assert _prompt_tokens(http) == before  # the engine never saw it
    ok = joined(inference(a).GenerateStream(gen([1, 2, 3], 2), metadata=(("x-data-parallel-rank", "0"),)))
    assert len(ok["tokens"]) == 2 and http.get("/ready").status_code == 200


# (case, token API sampling_params = top-level OpenAI keys, smg VllmEngine sampling fields, vllm.Inference fields,
#  vLLM's OpenAI route: "same" words; "refused" in vLLM's own words before tito's gate sees the request (its handler
#  refuses max_tokens above the context and a prompt past it); "served" (this server has the model's tokenizer))
SAME_WORDS: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any], str]] = [
    ("n above max_num_seqs", {"n": 1000}, {"n": 1000}, {"sampling": ipb.RandomSampling(num_sequences=1000)}, "same"),
    ("logprobs above max_logprobs", {"logprobs": 50}, {"logprobs": 50},
     {"response": ipb.ResponseOptions(output_logprobs=True, output_candidates=ipb.CandidateTokens(top_n=50))},
     "same"),
    ("stop id out of vocabulary", {"stop_token_ids": [99999]}, {"stop_token_ids": [99999]},
     {"stopping": ipb.StoppingCriteria(stop_token_ids=[99999])}, "same"),
    ("logit_bias id out of vocabulary", {"logit_bias": {"99999": 1.0}}, {"logit_bias": {99999: 1.0}},
     {"decoding": ipb.DecodingParameters(logit_bias={99999: 1.0})}, "same"),
    ("priority under fcfs", {}, {}, {"priority": 3}, "same"),
    ("prompt past the context", {}, {}, {}, "refused"),
    ("structured outputs", {"structured_outputs": {"regex": "a+"}}, {"regex": "a+"},
     {"decoding": ipb.DecodingParameters(regex="a+")}, "served"),
]


@pytest.mark.parametrize(("case", "sp", "smg", "native", "openai"), SAME_WORDS, ids=[c[0] for c in SAME_WORDS])
def test_one_rule_one_wording_on_every_transport(a: ServerProcess, http: httpx.Client, case: str, sp: dict[str, Any],
                                                 smg: dict[str, Any], native: dict[str, Any], openai: str) -> None:
    """The same bad input gets the same words from the token API, vLLM's /v1/completions (stream or not) and both
    gRPC services (smg's VllmEngine, vLLM's vllm.Inference), all from one validator, before the engine. Only the
    field's name follows each request's shape (``sampling_params.x`` on the token API and over gRPC, ``x`` at the top
    of an OpenAI body)."""
    from smg_grpc_proto import vllm_engine_pb2 as epb
    from smg_grpc_proto import vllm_engine_pb2_grpc as epb_grpc

    ids = [1] * 600 if case == "prompt past the context" else [1, 2, 3]
    priority = 3 if case == "priority under fcfs" else 0
    before = _prompt_tokens(http)
    r = http.post(GEN, json={"token_ids": ids, "sampling_params": {"max_tokens": 4, **sp}, "priority": priority})
    assert r.status_code == 400, r.text
    words = r.json()["error"]["message"]
    for stream in (False, True) if openai != "served" else ():
        o = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "stream": stream, "priority": priority,
                                                **sp})
        assert o.status_code == 400, (stream, o.text)
        if openai == "same":
            assert o.json()["error"]["message"] == words.replace("sampling_params.", ""), (stream, o.text)
    if not priority:  # smg's proto carries no priority
        smg_req = epb.GenerateRequest(tokenized=epb.TokenizedInput(input_ids=ids),
                                      sampling_params=epb.SamplingParams(**{"max_tokens": 4, **smg}))
        assert code_of(lambda: epb_grpc.VllmEngineStub(channel(a)).Generate(smg_req)) == (INVALID, words)
    native_req = gen(ids, 4)
    native_req.MergeFrom(ipb.GenerateRequest(**native))
    assert code_of(lambda: inference(a).GenerateStream(native_req)) == (INVALID, words)
    assert _prompt_tokens(http) == before  # the engine never saw any of them
    assert len(joined(inference(a).GenerateStream(gen([1, 2, 3], 2)))["tokens"]) == 2


def test_abort_ends_a_running_stream_and_is_idempotent(a: ServerProcess, http: httpx.Client) -> None:
    messages: list[ipb.GenerateResponse] = []
    first = threading.Event()

    def run() -> None:
        for m in inference(a).GenerateStream(gen([9, 8, 7], 500, request_id="to-abort")):
            messages.append(m)
            first.set()

    t = threading.Thread(target=run)
    t.start()
    assert first.wait(60)
    ctl = control(a)
    ctl.Abort(cpb.AbortRequest(request_ids=["to-abort"]))
    t.join(60)
    got = joined(messages)
    assert got["finish"].finish_reason == FINISH.ABORTED and 0 < len(got["tokens"]) < 500
    assert got["finish"].num_output_tokens == len(got["tokens"])
    for ids in (["to-abort"], ["never-seen"], []):  # finished, unknown, none: all fine
        ctl.Abort(cpb.AbortRequest(request_ids=ids))
    assert http.get("/health").json()["inflight"] == 0


def test_a_caller_that_leaves_frees_the_engine(a: ServerProcess, http: httpx.Client) -> None:
    call = inference(a).GenerateStream(gen([9, 8, 7, 6], 500))
    next(call)
    assert http.get("/health").json()["inflight"] == 1
    t0 = time.monotonic()
    call.cancel()
    wait_for(lambda: http.get("/health").json()["inflight"] == 0 and
             (metric_value(http.get("/metrics").text, "vllm:num_requests_running") or 0) == 0, 10,
             "the request to leave tito and its engine", every=0.02)
    assert time.monotonic() - t0 < 2.0
    cancelled = {"method": "GenerateStream", "code": "CANCELLED"}
    assert (metric_value(http.get("/metrics").text, "tito_grpc_requests_total", cancelled) or 0) >= 1
    assert "the caller left; aborting it in the engine" in a.log_text()


# ------------------------------------------------------------------------------------------------ control


def test_pause_resume_and_weight_version_are_titos_own(a: ServerProcess, http: httpx.Client) -> None:
    ctl = control(a)
    try:
        ctl.PauseGeneration(cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_KEEP))
        assert http.get("/is_paused").json() == {"is_paused": True}
        assert ctl.IsPaused(cpb.IsPausedRequest()).paused
        recent = http.get("/server_info").json()["state"]["control"]["recent"]
        assert recent[-1] == {"call": "pause (mode=keep)", "outcome": "ok"}
    finally:
        ctl.ResumeGeneration(cpb.ResumeGenerationRequest())
    assert http.get("/is_paused").json() == {"is_paused": False} and not ctl.IsPaused(cpb.IsPausedRequest()).paused
    try:
        ctl.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version="v-grpc"))
        assert ctl.GetWeightVersion(cpb.GetWeightVersionRequest()).weight_version == "v-grpc"
        assert http.get("/weight_info").json() == {"weight_version": "v-grpc"}
        assert http.get("/server_info").json()["state"]["weight_version"] == "v-grpc"
    finally:
        ctl.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version="default"))
    assert code_of(lambda: ctl.UpdateWeightVersion(cpb.UpdateWeightVersionRequest()))[0] is INVALID


def test_what_cpu_tito_does_not_offer_is_refused_clearly(a: ServerProcess) -> None:
    ctl = control(a)
    for call in (lambda: ctl.InitWeightTransferEngine(cpb.InitWeightTransferEngineRequest(init_info_json=b"{}")),
                 lambda: ctl.StartWeightUpdate(cpb.StartWeightUpdateRequest()),
                 lambda: ctl.UpdateWeights(cpb.UpdateWeightsRequest(update_info_json=b"{}")),
                 lambda: ctl.StartDraftWeightUpdate(cpb.StartDraftWeightUpdateRequest()),
                 lambda: ctl.Sleep(cpb.SleepRequest()), lambda: ctl.WakeUp(cpb.WakeUpRequest())):
        code, details = code_of(call)
        assert code is grpc.StatusCode.UNIMPLEMENTED and details
    assert code_of(lambda: ctl.UpdateWeights(cpb.UpdateWeightsRequest(update_info_json=b"[1]")))[0] is INVALID
    assert not ctl.IsSleeping(cpb.IsSleepingRequest()).sleeping


def test_lora_load_request_by_name_and_unload(a: ServerProcess, http: httpx.Client,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.test_lora import make_weights, write_adapter

    base = load_file(str(model_dir(a) / "model.safetensors"))
    path = write_adapter(tmp_path_factory.mktemp("sidecar-lora") / "ad", make_weights(base, 1))
    ctl = control(a)
    code, details = code_of(lambda: ctl.LoadLora(cpb.LoadLoraRequest(lora_name="ad", source_path="/etc")))
    assert code is grpc.StatusCode.PERMISSION_DENIED and "allowed" in details
    loaded = ctl.LoadLora(cpb.LoadLoraRequest(lora_name="ad", source_path=f"file://{path}")).adapter
    try:
        assert loaded.lora_id > 0 and loaded.lora_name == "ad" and loaded.source_path == str(path)
        assert list(ctl.ListLoras(cpb.ListLorasRequest()).adapters) == [loaded]
        assert "ad" in {m["id"] for m in http.get("/v1/models").json()["data"]}
        assert code_of(lambda: ctl.LoadLora(cpb.LoadLoraRequest(lora_name="ad", source_path=str(path))))[0] \
            is grpc.StatusCode.ALREADY_EXISTS
        for ids in PROMPTS:
            direct = _http_greedy(http, ids, 8)
            by_model = http.post(GEN, json={"model": "ad", "token_ids": ids, "sampling_params": {
                "max_tokens": 8, "temperature": 0, "ignore_eos": True}}).json()["choices"][0]["token_ids"]
            got = joined(inference(a).GenerateStream(gen(ids, 8, lora_name="ad")))["tokens"]
            assert got == by_model != direct["choices"][0]["token_ids"]
    finally:
        gone = ctl.UnloadLora(cpb.UnloadLoraRequest(lora_name="ad")).adapter
    assert gone == loaded and not ctl.ListLoras(cpb.ListLorasRequest()).adapters
    assert code_of(lambda: ctl.UnloadLora(cpb.UnloadLoraRequest(lora_name="ad")))[0] is grpc.StatusCode.NOT_FOUND
