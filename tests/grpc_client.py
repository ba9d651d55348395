"""Test helpers for tito's gRPC surface: a client built from ``smg-grpc-proto`` for the replicas with ``--grpc-port``
(the shared ``grpc_a`` / ``grpc_b``, tests/conftest.py) and the smg gateway in front of them."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from tests.helpers import ServerProcess, engine_env, free_port


@dataclass
class Replica:
    server: ServerProcess
    grpc_port: int

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def stub(self) -> pb_grpc.VllmEngineStub:
        return pb_grpc.VllmEngineStub(self.channel())

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120.0)


def admin_call(r: Replica, method: str, path: str, **kw: Any) -> httpx.Response:
    """An HTTP call on the replica that must answer 200."""
    with r.http() as c:
        resp = c.request(method, path, **kw)
    assert resp.status_code == 200, resp.text
    return resp


def health_of(r: Replica) -> dict[str, Any]:
    with r.http() as c:
        return c.get("/health").json()


def until(pred: Any, timeout: float = 60.0, interval: float = 0.05) -> None:
    """Poll ``pred()`` until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        time.sleep(interval)


def gen_request(ids: Sequence[int], max_tokens: int, *, stream: bool = False, request_id: str = "",
                logprobs: int | None = None, prompt_logprobs: int | None = None, ignore_eos: bool = False,
                **sampling: Any) -> pb.GenerateRequest:
    sp = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, **sampling)
    if logprobs is not None:
        sp.logprobs = logprobs
    if prompt_logprobs is not None:
        sp.prompt_logprobs = prompt_logprobs
    return pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=list(ids)),
                              sampling_params=sp, stream=stream)


def collect(responses: Iterable[pb.GenerateResponse]) -> dict[str, Any]:
    """Tokens (from the chunks of a stream, or the one complete of a unary call), logprobs, finish reason."""
    out: dict[str, Any] = {"tokens": [], "logprobs": [], "top": [], "finish": None, "chunks": 0, "prompt_lp": None}
    streamed = False
    for r in responses:
        kind = r.WhichOneof("response")
        msg = r.chunk if kind == "chunk" else r.complete
        if kind == "chunk":
            streamed = True
            out["chunks"] += 1
        if kind == "complete":
            out["finish"] = msg.finish_reason
            out["completion_tokens"] = msg.completion_tokens
            if streamed:
                continue  # a stream's complete repeats its last delta (vLLM's servicer does the same)
        ids = list(msg.output_ids if kind == "complete" else msg.token_ids)
        out["tokens"] += ids
        lp = msg.output_logprobs
        out["logprobs"] += list(lp.token_logprobs)
        out["top"] += [list(zip(t.token_ids, t.values, strict=True)) for t in lp.top_logprobs]
        if msg.HasField("input_logprobs"):
            out["prompt_lp"] = [e.value if e.HasField("value") else None for e in msg.input_logprobs.token_logprobs]
    return out


def code_of(fn: Any) -> tuple[grpc.StatusCode, str]:
    """The status code and details a call ends with (OK and "" if it succeeds)."""
    try:
        res = fn()
        if hasattr(res, "__iter__") and not isinstance(res, (str, bytes)):
            list(res)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


# --------------------------------------------------------------------------------------------------- smg gateway


def smg_binary() -> str:
    found = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    if not Path(found).exists():
        pytest.fail("the smg gateway is not installed (pip install 'tito[test]')")
    return found


def start_smg(workers: Sequence[Replica], model_dir: Path, log_path: Path, policy: str = "cache_aware",
              timeout: float = 120.0) -> ServerProcess:
    """The smg gateway (Rust) routing to ``workers`` over gRPC; ready once it lists every worker healthy."""
    port, prometheus = free_port(), free_port()
    cmd = [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *[f"grpc://{w.target}" for w in workers], "--policy", policy,
           "--model-path", str(model_dir), "--prometheus-port", str(prometheus),
           "--log-level", "info"]
    proc = ServerProcess(cmd, port, log_path, env=engine_env(), health_path="/health")
    proc.metrics_url = f"http://127.0.0.1:{prometheus}/metrics"  # type: ignore[attr-defined]
    proc.start(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(proc.url + "/workers", timeout=5.0)
            if r.status_code == 200 and _healthy_workers(r.json()) >= len(workers):
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"smg did not list {len(workers)} healthy workers:\n{proc.log_tail()}")


def _healthy_workers(body: Any) -> int:
    workers = body.get("workers", body) if isinstance(body, dict) else body
    if not isinstance(workers, list):
        return 0
    return sum(1 for w in workers if isinstance(w, dict) and w.get("is_healthy", w.get("healthy", True)))
