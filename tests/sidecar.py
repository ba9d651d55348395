"""Helpers for the tests of vLLM's native gRPC services and Dynamo's own vLLM sidecar (ai-dynamo 1.6.1) in front of
them: stubs for a replica's ``vllm.Control`` / ``vllm.Inference``, and Dynamo processes on one CPU box (file
discovery, TCP request plane, ZMQ event plane, everything on loopback)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from tokenizers import Tokenizer

from app.dynamo.sidecar import (
    dynamo_available,  # noqa: F401 - the test modules' skip condition
    free_system_port,
)
from app.grpc.proto import vllm_control_pb2_grpc as cpb_grpc
from app.grpc.proto import vllm_inference_pb2 as ipb
from app.grpc.proto import vllm_inference_pb2_grpc as ipb_grpc
from tests.helpers import ServerProcess, engine_env, free_port

MODEL = "tiny"  # the replicas' --served-model-name
BLOCK = 32  # their KV block size: a few blocks of prompt publish KV events
NS = "titosidecar"
FINISH = ipb.FinishInfo.FinishReason


def grpc_port(server: ServerProcess) -> int:
    return int(server.cmd[server.cmd.index("--grpc-port") + 1])


def model_dir(server: ServerProcess) -> Path:
    return Path(server.cmd[server.cmd.index("--model") + 1])


def channel(server: ServerProcess) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{grpc_port(server)}")


def control(server: ServerProcess) -> cpb_grpc.ControlStub:
    return cpb_grpc.ControlStub(channel(server))


def inference(server: ServerProcess) -> ipb_grpc.InferenceStub:
    return ipb_grpc.InferenceStub(channel(server))


def gen(ids: list[int], n: int, *, logprobs: int | None = None, prompt_logprobs: int | None = None,
        request_id: str = "", model: str = MODEL, **kw: Any) -> ipb.GenerateRequest:
    """A greedy request as the sidecar sends one: token ids in, token ids and text out."""
    response = ipb.ResponseOptions(output_text=True, output_token_ids=True)
    if logprobs is not None:
        response.output_logprobs = True
        response.output_candidates.top_n = logprobs
    if prompt_logprobs is not None:
        response.prompt_token_ids = response.prompt_logprobs = True
        response.prompt_candidates.top_n = prompt_logprobs
    stopping = kw.pop("stopping", None) or ipb.StoppingCriteria(max_new_tokens=n, ignore_eos=True)
    return ipb.GenerateRequest(request_id=request_id, model=model, token_ids=ipb.TokenIds(ids=ids), temperature=0.0,
                               sampling=ipb.RandomSampling(num_sequences=1), stopping=stopping, response=response,
                               **kw)


def joined(messages: Iterable[ipb.GenerateResponse]) -> dict[str, Any]:
    """A stream's messages of sequence 0: tokens, text, logprobs, the first message's prompt info, the finish."""
    out: dict[str, Any] = {"tokens": [], "text": "", "logprobs": [], "ranks": [], "candidates": [], "finish": None,
                           "prompt": None, "messages": 0}
    for m in messages:
        out["messages"] += 1
        if m.HasField("prompt_info"):
            assert out["prompt"] is None and out["messages"] == 1, "prompt_info in the first message only"
            out["prompt"] = m.prompt_info
        o = m.outputs
        assert o.num_tokens == len(o.token_ids)
        out["tokens"] += list(o.token_ids)
        out["text"] += o.text
        out["logprobs"] += list(o.logprobs)
        out["ranks"] += list(o.ranks)
        out["candidates"] += [[(t.id, t.logprob) for t in c.tokens] for c in o.candidate_tokens]
        if o.HasField("finish_info"):
            assert out["finish"] is None
            out["finish"] = o.finish_info
    return out


def stream_matches_http(server: ServerProcess, http: httpx.Client, ids: list[int], *, prompt_logprobs: bool,
                        model: str = MODEL) -> None:
    """``GenerateStream`` and ``Generate`` against tito's HTTP token route on the same server, greedy: the same tokens
    and logprobs (1e-5), the tokenizer's text, the sidecar's stream shape; with ``prompt_logprobs`` also the prompt's
    logprobs and ranks."""
    tok = Tokenizer.from_file(str(model_dir(server) / "tokenizer.json"))
    plp = {"prompt_logprobs": 1} if prompt_logprobs else {}
    r = http.post("/inference/v1/generate", json={"token_ids": ids, "sampling_params": {
        "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2, **plp}})
    assert r.status_code == 200, r.text
    direct = r.json()
    choice = direct["choices"][0]
    req = gen(ids, 12, logprobs=2, model=model, **({"prompt_logprobs": 1} if prompt_logprobs else {}))
    got = joined(inference(server).GenerateStream(req))
    assert got["tokens"] == choice["token_ids"]
    assert got["messages"] > 1  # a message per engine step
    # The detokenized deltas add up to the decoded output, but for an incomplete last character (random weights
    # sample byte tokens), which vLLM's incremental detokenizer holds back too.
    assert got["text"] == tok.decode(got["tokens"]).removesuffix("\ufffd")
    want = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert got["logprobs"] == pytest.approx(want, abs=1e-5)
    # The sampled token is rank 1 (greedy); the candidates are the other tokens of the top 2.
    assert got["ranks"] == [1] * 12
    for cands, entry in zip(got["candidates"], choice["logprobs"]["content"], strict=True):
        others = [t["token_id"] for t in entry["top_logprobs"] if t["token_id"] != entry["token_id"]]
        assert [c[0] for c in cands] == others
    prompt = got["prompt"]
    assert prompt.num_prompt_tokens == len(ids)
    if prompt_logprobs:
        assert list(prompt.token_ids) == ids
        assert len(prompt.logprobs) == len(prompt.ranks) == len(prompt.candidate_tokens) == len(ids)
        http_prompt = [p[str(t)] for t, p in zip(ids[1:], direct["prompt_logprobs"][1:], strict=True)]
        assert list(prompt.logprobs)[1:] == pytest.approx([p["logprob"] for p in http_prompt], abs=1e-5)
        assert list(prompt.ranks)[1:] == [p["rank"] for p in http_prompt]
    else:
        assert not prompt.logprobs
    f = got["finish"]
    assert f.finish_reason == FINISH.LENGTH and f.num_output_tokens == 12
    # Generate (unary) is the same answer in one message.
    one = inference(server).Generate(req)
    assert list(one.outputs.token_ids) == got["tokens"] and one.outputs.text == got["text"]
    assert one.outputs.finish_info == f and one.prompt_info == prompt


def code_of(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    """The status code and details a call ends with (OK and "" if it succeeds)."""
    try:
        res = fn()
        if hasattr(res, "__iter__") and not isinstance(res, (str, bytes)) and not hasattr(res, "DESCRIPTOR"):
            list(res)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


# ------------------------------------------------------------------------------------------------ Dynamo processes


def system_port() -> int:
    return free_system_port()


def dynamo_kv_dir(basetemp: Path) -> Path:
    """The file-discovery directory every Dynamo process of the session's sidecar tests shares."""
    d = basetemp / "sidecar-dynamo-kv"
    d.mkdir(exist_ok=True)
    return d


def child_system_url(server: ServerProcess) -> str:
    """The system URL of the sidecar a replica started itself (``--dynamo-namespace --dynamo-system-port``)."""
    return f"http://127.0.0.1:{server.cmd[server.cmd.index('--dynamo-system-port') + 1]}"


def dynamo_env(kv_dir: Path) -> dict[str, str]:
    return {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(kv_dir), "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq", "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1", "DYN_NAMESPACE": NS,
            "DYN_LOG": "warn"}


def start_frontend(env: dict[str, str], log: Path, mode: str = "kv",
                   extra_env: dict[str, str] | None = None) -> tuple[ServerProcess, str]:
    """Dynamo's frontend (OpenAI API, ``/inference/v1/generate``, RL discovery, request migration); returns it and its
    RL URL. ``extra_env``: e.g. ``DYN_LORA_ENABLED=true`` (LoRA-aware routing)."""
    port = free_port()
    while (rl := free_port()) == port:
        pass
    cmd = [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
           "--router-mode", mode, "--migration-limit", "3"]
    extra = {"DYN_ENABLE_RL": "true", "DYN_RL_PORT": str(rl), "DYN_VLLM_ENABLE_INFERENCE_V1_GENERATE": "true",
             **(extra_env or {})}
    proc = ServerProcess(cmd, port, log, env=engine_env({**env, **extra}), health_path="/live").start(timeout=120)
    return proc, f"http://127.0.0.1:{rl}"


def start_sidecar(env: dict[str, str], replica: ServerProcess, log: Path) -> ServerProcess:
    """``python -m dynamo.vllm.sidecar`` for ``replica``, started by hand as the docs show: ready once its system
    port's ``/health`` answers 200 (it has connected, discovered the model and registered)."""
    port = system_port()
    cmd = [sys.executable, "-m", "dynamo.vllm.sidecar", "--grpc-endpoint", f"127.0.0.1:{grpc_port(replica)}",
           "--enable-rl", "--vllm-http-endpoint", replica.url]
    extra = {"DYN_SYSTEM_PORT": str(port), "DYN_LORA_ENABLED": "true"}
    return ServerProcess(cmd, port, log, env=engine_env({**env, **extra}), health_path="/health").start(timeout=180)


def models_listed(fe: ServerProcess) -> set[str]:
    try:
        return {m["id"] for m in httpx.get(fe.url + "/v1/models", timeout=10).json().get("data", [])}
    except httpx.HTTPError:
        return set()


def rl_workers(rl_url: str) -> list[dict[str, Any]]:
    r = httpx.get(rl_url + "/v1/rl/workers", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["protocol_version"] == 1
    return list(body["workers"])

