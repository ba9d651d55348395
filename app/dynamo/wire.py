"""What goes over the wire between Dynamo's request plane and tito's HTTP API (pure functions, no Dynamo import).

Dynamo's frontend tokenizes, applies the chat template and sends a preprocessed token request (``token_ids``,
``sampling_options``, ``stop_conditions``, ``output_options``, ``routing``, ...) to a worker's ``generate`` endpoint;
the worker streams ``LLMEngineOutput`` chunks (``token_ids``, ``finish_reason``, ``log_probs``, ``top_logprobs``,
``completion_usage``, ``disaggregated_params``) back, and the frontend detokenizes them. These functions turn one
into tito's ``/inference/v1/generate`` (streaming SSE) and back, and decide what the model card says.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from app.client.wire import sse_payload

GENERATE_PATH = "/inference/v1/generate"

# Dynamo sampling options tito's wire sampling params take under the same name.
_SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")


class BadRequest(ValueError):
    """tito refused the request (4xx): the frontend must answer the client with a 4xx too."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def to_tito_request(request: dict[str, Any], request_id: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Dynamo's preprocessed token request → (tito ``GenerateRequest`` body, extra headers), streaming.

    Stop strings stay with the frontend (it matches them while detokenizing; tito is tokens-only). The model's eos
    ids arrive as ``eos_token_ids`` and become stop ids unless ``ignore_eos``. A router's choice of data-parallel
    rank (``routing.dp_rank``, KV-aware routing) becomes tito's ``X-data-parallel-rank`` header.
    """
    if not isinstance(request.get("token_ids"), list):
        raise BadRequest(400, "request needs token_ids (a list of ints)")
    so = request.get("sampling_options") or {}
    sc = request.get("stop_conditions") or {}
    oo = request.get("output_options") or {}
    sp: dict[str, Any] = {key: so[key] for key in _SAMPLING_KEYS if so.get(key) is not None}
    for key in ("max_tokens", "min_tokens"):
        if sc.get(key) is not None:
            sp[key] = sc[key]
    ignore_eos = bool(sc.get("ignore_eos"))
    if sc.get("ignore_eos") is not None:
        sp["ignore_eos"] = ignore_eos
    stops = set(sc.get("stop_token_ids") or []) | set(sc.get("stop_token_ids_hidden") or [])
    if not ignore_eos:
        stops |= set(request.get("eos_token_ids") or [])
    if stops:
        sp["stop_token_ids"] = sorted(stops)
    if oo.get("logprobs") is not None:
        sp["logprobs"] = int(oo["logprobs"])
    body: dict[str, Any] = {"token_ids": list(request["token_ids"]), "sampling_params": sp, "stream": True,
                            "stream_options": {"include_usage": True}}
    if request.get("model"):
        body["model"] = request["model"]
    kv = kv_transfer_params(request)
    if kv is not None:
        body["kv_transfer_params"] = kv
    headers: dict[str, str] = {}
    if request_id:
        headers["X-Request-Id"] = request_id
    rank = (request.get("routing") or {}).get("dp_rank")
    if rank is not None:
        headers["X-data-parallel-rank"] = str(int(rank))
    return body, headers


def kv_transfer_params(request: dict[str, Any]) -> dict[str, Any] | None:
    """Disaggregated decode: the prefill worker's ``kv_transfer_params`` (Dynamo puts its answer in
    ``prefill_result.disaggregated_params``), threaded to tito as vLLM's ``kv_transfer_params``."""
    prefill = request.get("prefill_result")
    if isinstance(prefill, dict):
        params = (prefill.get("disaggregated_params") or {}).get("kv_transfer_params")
        if isinstance(params, dict):
            return params
    extra = request.get("extra_args")
    if isinstance(extra, dict) and isinstance(extra.get("kv_transfer_params"), dict):
        return dict(extra["kv_transfer_params"])
    return None


def to_dynamo_chunk(choice: dict[str, Any]) -> dict[str, Any]:
    """One streamed tito choice → one Dynamo ``LLMEngineOutput`` chunk."""
    out: dict[str, Any] = {"token_ids": list(choice.get("token_ids") or []), "index": int(choice.get("index", 0))}
    if choice.get("finish_reason"):
        out["finish_reason"] = choice["finish_reason"]
    content = (choice.get("logprobs") or {}).get("content")
    if content:
        out["log_probs"] = [e["logprob"] for e in content]
        out["top_logprobs"] = [[{"token_id": t["token_id"], "logprob": t["logprob"], "rank": t.get("rank")}
                                for t in e.get("top_logprobs", [])] for e in content]
    return out


def completion_usage(usage: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens") if k in usage}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def error_message(status: int, body: bytes) -> str:
    """tito's error body (``{"error": {"message": ...}}``) → one line for the client."""
    try:
        err = orjson.loads(body)
        msg = err.get("error", {}).get("message") if isinstance(err, dict) else None
        if msg:
            return str(msg)
    except orjson.JSONDecodeError:
        pass
    return body.decode(errors="replace")[:2000] or f"HTTP {status}"


async def sse_events(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The events of tito's streamed answer, error events included (the adapter turns them into Dynamo errors)."""
    async for line in resp.aiter_lines():
        event = sse_payload(line)
        if event is not None:
            yield event


# Dynamo's canary: one greedy token through the whole path (adapter → tito → engine).
CANARY = {"token_ids": [1], "stop_conditions": {"max_tokens": 1, "ignore_eos": True},
          "sampling_options": {"temperature": 0.0}}


@dataclass(frozen=True)
class CardFacts:
    """What the model card tells the frontend and its router, from tito's ``/server_info``."""

    name: str
    path: str
    serves_text: bool  # Chat + Completions (the frontend tokenizes), else ModelType.Empty (discovery only)
    context_length: int
    kv_block_size: int
    total_kv_blocks: int
    max_num_seqs: int
    data_parallel_size: int
    kv_events: dict[int, str]  # DP rank -> ZMQ address tito's engine publishes KV events on

    @classmethod
    def from_server_info(cls, info: dict[str, Any]) -> CardFacts:
        m, par = info["model"], info.get("parallelism", {})
        dp = int(par.get("data_parallel_size") or 1)
        events = {int(r): local_zmq(ep) for r, ep in (info.get("features", {}).get("kv_events") or {}).items()}
        return cls(name=m["served_model_name"], path=m["path"], serves_text=bool(m.get("has_tokenizer")),
                   context_length=int(m["max_model_len"]), kv_block_size=int(m.get("kv_block_size") or 0),
                   total_kv_blocks=int(m.get("num_kv_blocks") or 0) * dp, max_num_seqs=int(m["max_num_seqs"]),
                   data_parallel_size=dp, kv_events=events)


def local_zmq(endpoint: str) -> str:
    """A bound wildcard (``tcp://*:5557``) is reached on loopback: the adapter runs beside tito."""
    return endpoint.replace("*", "127.0.0.1")
