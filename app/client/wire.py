"""What the tito client sends and how it reads the answers, shared by both transports in ``app.client.clients``.

One request builder (``Routes``: a ``Call`` per route, with its plane, timeout and whether it is safe to repeat),
one response parser (``TitoError``, ``GenerateResult``, ``StreamDelta``, the SSE parser) and one retry policy. The
transports (``TitoClient`` on ``httpx.Client``, ``AsyncTitoClient`` on ``httpx.AsyncClient``) only send.
httpx and the standard library only (never vLLM or torch).
"""

from __future__ import annotations

import base64
import json
import mimetypes
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import httpx

if TYPE_CHECKING:
    from typing_extensions import Unpack

DEFAULT_URL = "http://127.0.0.1:8000"
# Generous but finite: a long rollout on a slow engine can take minutes; nothing waits forever.
GENERATE_TIMEOUT = 600.0
ADMIN_TIMEOUT = 300.0
UPDATE_WEIGHTS_TIMEOUT = 720.0
PROBE_TIMEOUT = 10.0
_RETRY_STATUS = frozenset({502, 504})


# --------------------------------------------------------------------------------------------------- errors


class TitoError(Exception):
    """Any failed call: an HTTP error answer, a transport failure or a timeout.

    ``status`` is the HTTP status (0 when no answer arrived); ``error`` is the server's envelope
    (``{"message", "type", "param", "code"}``) when it sent one, else a synthesized one; ``body`` is the raw answer.
    """

    def __init__(self, status: int, message: str, *, error: dict[str, Any] | None = None, body: Any = None,
                 method: str = "", path: str = "") -> None:
        self.status = status
        self.message = message
        self.error = error if error is not None else {"message": message, "type": "ClientError", "param": None,
                                                      "code": status}
        self.body = body
        self.method = method
        self.path = path
        where = f"{method} {path}: " if method else ""
        super().__init__(f"{where}{status or 'no answer'}: {message}")

    @property
    def type(self) -> str | None:
        t = self.error.get("type")
        return None if t is None else str(t)

    @property
    def param(self) -> str | None:
        p = self.error.get("param")
        return None if p is None else str(p)


def error_from_response(resp: httpx.Response, method: str, path: str) -> TitoError:
    body: Any
    try:
        body = resp.json()
    except ValueError:
        body = resp.text
    env = body.get("error") if isinstance(body, dict) else None
    if isinstance(env, dict):
        return TitoError(resp.status_code, str(env.get("message", "")), error=env, body=body, method=method,
                         path=path)
    if isinstance(body, dict) and isinstance(env, str):  # e.g. {"error": "..."} from vLLM's dev routes
        msg = env
    elif isinstance(body, dict):
        msg = json.dumps(body)
    else:
        msg = (body or resp.reason_phrase or "").strip()[:1000]
    return TitoError(resp.status_code, msg, body=body, method=method, path=path)


# --------------------------------------------------------------------------------------------------- results


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int | None = None

    @classmethod
    def parse(cls, d: dict[str, Any] | None) -> Usage | None:
        if not d:
            return None
        details = d.get("prompt_tokens_details") or {}
        return cls(int(d.get("prompt_tokens", 0)), int(d.get("completion_tokens", 0)), int(d.get("total_tokens", 0)),
                   details.get("cached_tokens"))


def _logprob_values(lp: dict[str, Any] | None) -> list[float] | None:
    if not lp or lp.get("content") is None:
        return None
    return [float(e["logprob"]) for e in lp["content"]]


@dataclass
class Choice:
    index: int
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None  # the sampled token's logprob, one per token in ``token_ids``
    top_logprobs: list[list[dict[str, Any]]] | None = None  # candidates per position, as the server sent them
    weight_versions: list[dict[str, Any]] | None = None

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Choice:
        lp = d.get("logprobs")
        tops = [e.get("top_logprobs") or [] for e in lp["content"]] if lp and lp.get("content") is not None else None
        return cls(index=int(d.get("index", 0)), token_ids=list(d.get("token_ids") or []),
                   finish_reason=d.get("finish_reason"), stop_reason=d.get("stop_reason"),
                   logprobs=_logprob_values(lp), top_logprobs=tops, weight_versions=d.get("weight_versions"))


@dataclass
class GenerateResult:
    """A non-streamed answer of ``POST /inference/v1/generate``. ``raw`` is the full JSON."""

    request_id: str
    model: str | None
    choices: list[Choice]
    usage: Usage | None
    prompt_logprobs: list[dict[str, Any] | None] | None
    prompt_token_ids: list[int] | None
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def parse(cls, d: dict[str, Any]) -> GenerateResult:
        return cls(request_id=d["request_id"], model=d.get("model"),
                   choices=[Choice.parse(c) for c in d.get("choices") or []], usage=Usage.parse(d.get("usage")),
                   prompt_logprobs=d.get("prompt_logprobs"), prompt_token_ids=d.get("prompt_token_ids"), raw=d)

    # The first choice, for the common n=1 case.
    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def logprobs(self) -> list[float] | None:
        return self.choices[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason


@dataclass
class StreamDelta:
    """One streamed event: new tokens of one choice, or (``usage`` set, ``index`` -1) the closing usage chunk."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    usage: Usage | None
    raw: dict[str, Any] = field(repr=False)


def stream_deltas(event: dict[str, Any]) -> list[StreamDelta]:
    rid = event.get("request_id", "")
    usage = Usage.parse(event.get("usage"))
    choices = event.get("choices") or []
    if not choices:
        return [StreamDelta(rid, -1, [], None, None, usage, event)]
    return [StreamDelta(rid, int(c.get("index", 0)), list(c.get("token_ids") or []), _logprob_values(c.get("logprobs")),
                        c.get("finish_reason"), usage, event) for c in choices]


def sse_payload(line: str) -> Any:
    """The JSON of one ``data:`` line of tito's SSE answer; None for blank lines, comments and ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    return json.loads(payload)


def sse_event(line: str, method: str, path: str) -> dict[str, Any] | None:
    """Parse one SSE line (``sse_payload``); raise on an error event."""
    event = sse_payload(line)
    if event is None:
        return None
    if isinstance(event, dict) and isinstance(event.get("error"), dict):
        env = event["error"]
        raise TitoError(int(env.get("code") or 500), str(env.get("message", "")), error=env, body=event,
                        method=method, path=path)
    return event


# --------------------------------------------------------------------------------------------------- calls

_DATA, _ADMIN, _OPEN = "data", "admin", "open"


@dataclass
class Call:
    """Everything about one HTTP call except how it is sent (shared by the async and the blocking client)."""

    method: str
    path: str
    plane: str = _ADMIN
    json: Any = None
    params: dict[str, Any] | None = None
    headers: dict[str, str] | None = None
    timeout: float | None = ADMIN_TIMEOUT
    idempotent: bool = False
    parse: Callable[[httpx.Response], Any] = field(default=lambda r: _json_or_none(r))


def _json_or_none(resp: httpx.Response) -> Any:
    if not resp.content:
        return None
    try:
        return resp.json()
    except ValueError:
        return resp.text


def _bool(v: bool) -> str:
    return "true" if v else "false"


def transport_error(exc: Exception, call: Call) -> TitoError:
    kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
    return TitoError(0, f"request {kind}: {type(exc).__name__}: {exc}", method=call.method, path=call.path)


def image_parts(images: list[Any]) -> list[dict[str, str]]:
    """``content_parts`` for images given as file paths, raw bytes or URLs (``data:``/``http(s):``/``file:``):
    paths and bytes are sent inline as data URLs, which any tito server takes."""
    parts = []
    for img in images:
        if isinstance(img, str) and img.split(":", 1)[0] in ("data", "http", "https", "file"):
            url = img
        else:
            raw = img if isinstance(img, bytes) else Path(img).read_bytes()
            mime = "image/png" if isinstance(img, bytes) else mimetypes.guess_type(str(img))[0] or "image/png"
            url = f"data:{mime};base64,{base64.b64encode(raw).decode()}"
        parts.append({"type": "image_url", "url": url})
    return parts


class GenerateOptions(TypedDict, total=False):
    """Keyword arguments of ``generate`` and ``generate_stream`` (sampling keywords override ``sampling_params``)."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    n: int | None
    logprobs: int | None
    prompt_logprobs: int | None
    stop_token_ids: list[int] | None
    ignore_eos: bool | None
    request_id: str | None
    model: str | None
    cache_salt: str | None
    priority: int | None
    return_token_ids: bool | None
    data_parallel_rank: int | None
    extra: dict[str, Any] | None
    timeout: float | None
    images: list[Any] | None  # paths, bytes or URLs, sent as content_parts (token_ids hold one image token each)


_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "logprobs", "prompt_logprobs",
                  "stop_token_ids", "ignore_eos")
_BODY_KEYS = ("request_id", "model", "cache_salt", "priority", "return_token_ids")


class Routes:
    """The request builder: one ``Call`` per route, sent by the transport's ``_send`` (which returns the parsed
    answer: a value for ``TitoClient``, an awaitable of it for ``AsyncTitoClient``)."""

    def __init__(self, base_url: str, api_key: str | None, admin_api_key: str | None, timeout: float,
                 retries: int, backoff: float) -> None:
        base = base_url.rstrip("/")
        # Accept Prime-RL style URLs ending in /v1: routes here are root-relative.
        self.base_url = base[:-3] if base.endswith("/v1") else base
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff

    def _send(self, call: Call) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ building

    def _auth(self, plane: str) -> dict[str, str]:
        key = self.api_key if plane == _DATA else (self.admin_api_key or self.api_key) if plane == _ADMIN else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _request_args(self, call: Call) -> dict[str, Any]:
        """What the transport passes to ``httpx`` ``request``/``stream``."""
        headers = self._auth(call.plane)
        if call.headers:
            headers.update(call.headers)
        read = call.timeout if call.timeout is not None else self.timeout
        return {"method": call.method, "url": call.path, "json": call.json, "params": call.params,
                "headers": headers, "timeout": httpx.Timeout(read, connect=min(10.0, read))}

    def _generate_call(self, token_ids: list[int], sampling_params: dict[str, Any] | None, *, stream: bool,
                       include_usage: bool = False, **kw: Unpack[GenerateOptions]) -> Call:
        opts: dict[str, Any] = dict(kw)
        unknown = set(opts) - set(GenerateOptions.__annotations__)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
        sp = dict(sampling_params or {})
        sp.update({k: opts[k] for k in _SAMPLING_KEYS if opts.get(k) is not None})
        body: dict[str, Any] = {"token_ids": list(token_ids), "sampling_params": sp}
        body.update({k: opts[k] for k in _BODY_KEYS if opts.get(k) is not None})
        if stream:
            body["stream"] = True
            if include_usage:
                body["stream_options"] = {"include_usage": True}
        if opts.get("images"):
            body["content_parts"] = image_parts(opts["images"])
        body.update(opts.get("extra") or {})
        rank = opts.get("data_parallel_rank")
        timeout = opts.get("timeout")
        return Call("POST", "/inference/v1/generate", _DATA, json=body,
                     headers={"X-data-parallel-rank": str(rank)} if rank is not None else None,
                     timeout=GENERATE_TIMEOUT if timeout is None else timeout,
                     parse=lambda r: GenerateResult.parse(r.json()))

    # ------------------------------------------------------------------ retry policy

    def _retry_delay(self, call: Call, attempt: int, failure: Exception | httpx.Response) -> float:
        """Seconds to wait before trying ``call`` again, or raise its ``TitoError`` when it must not be retried:
        calls that are safe to repeat on connection errors and 502/504, any call when the connection was never
        made (the server cannot have seen it)."""
        if isinstance(failure, httpx.Response):
            retry = call.idempotent and failure.status_code in _RETRY_STATUS
        else:
            retry = isinstance(failure, (httpx.ConnectError, httpx.ConnectTimeout)) or \
                (call.idempotent and isinstance(failure, httpx.TransportError))
        if not retry or attempt >= self.retries:
            if isinstance(failure, httpx.Response):
                raise error_from_response(failure, call.method, call.path)
            raise transport_error(failure, call) from failure
        return min(self.backoff * (2 ** attempt), 5.0) * (0.5 + random.random() / 2)

    # ------------------------------------------------------------------ admin and probe routes (answers: the JSON)

    def abort(self, request_ids: list[str] | str | None) -> Any:
        """``POST /abort_requests``: abort by the client's ids or the answered ``generate-tokens-<id>``; None aborts
        every request in flight. Aborted requests still answer, with ``finish_reason == "abort"``."""
        if request_ids is None:
            body: dict[str, Any] = {}  # every request in flight
        else:
            body = {"request_ids": [request_ids] if isinstance(request_ids, str) else list(request_ids)}
        return self._send(Call("POST", "/abort_requests", json=body, idempotent=True, timeout=PROBE_TIMEOUT * 3))

    def pause(self, mode: str = "keep", clear_cache: bool = False, timeout: float | None = None, *,
              lease: float | None = None) -> Any:
        """``POST /pause``: ``keep`` parks in-flight requests, ``wait`` lets them finish, ``abort`` ends them.
        ``lease``: seconds after which the server resumes by itself if no control call comes (None: its
        ``--pause-lease``). Prefer ``with client.paused(): ...``, which always resumes."""
        params: dict[str, Any] = {"mode": mode, "clear_cache": _bool(clear_cache)}
        if lease is not None:
            params["lease"] = lease
        return self._send(Call("POST", "/pause", params=params, idempotent=True, timeout=timeout or ADMIN_TIMEOUT))

    def resume(self) -> Any:
        return self._send(Call("POST", "/resume", idempotent=True))

    def is_paused(self) -> Any:
        """``GET /is_paused``: a bool."""
        return self._send(Call("GET", "/is_paused", idempotent=True, timeout=PROBE_TIMEOUT,
                                parse=lambda r: bool(r.json()["is_paused"])))

    def update_weights(self, weight_dir: str | None, weight_version: str | None = None,
                       timeout: float | None = None) -> Any:
        """``POST /update_weights``: load HF safetensors from ``weight_dir`` (None: take the NCCL broadcast)."""
        body: dict[str, Any] = {"weight_dir": None if weight_dir is None else str(weight_dir)}
        if weight_version is not None:
            body["weight_version"] = weight_version
        # Not idempotent: a repeated NCCL update would wait for a broadcast that never comes.
        return self._send(Call("POST", "/update_weights", json=body, timeout=timeout or UPDATE_WEIGHTS_TIMEOUT))

    def init_broadcaster(self, host: str, port: int, rank_offset: int, inference_world_size: int,
                         timeout: float = 1200.0, extra: dict[str, Any] | None = None) -> Any:
        """``POST /init_broadcaster``: join the trainer's weight-broadcast group (blocks until it forms)."""
        body = {"host": host, "port": port, "rank_offset": rank_offset, "inference_world_size": inference_world_size,
                "timeout": timeout, **(extra or {})}
        # The server blocks until the group forms (up to ``timeout``); give the answer some slack beyond that.
        return self._send(Call("POST", "/init_broadcaster", json=body, timeout=float(timeout) + 30.0))

    def load_lora(self, name: str, path: str, *, v1: bool = False) -> Any:
        """Load (or reload in place, same name) a PEFT adapter; ``v1=True`` uses vLLM's ``/v1/`` route."""
        # Prime-RL's route reloads the same name in place, so a repeat is harmless; vLLM's answers a repeat with 400.
        return self._send(Call("POST", "/v1/load_lora_adapter" if v1 else "/load_lora_adapter",
                                json={"lora_name": name, "lora_path": str(path)}, idempotent=not v1, timeout=120.0))

    def unload_lora(self, name: str) -> Any:
        return self._send(Call("POST", "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60.0))

    def drain(self, timeout: float | None = None) -> Any:
        """``POST /drain``: refuse new generations and wait up to ``timeout`` s for in-flight ones to finish."""
        body = {} if timeout is None else {"timeout": timeout}
        return self._send(Call("POST", "/drain", json=body, idempotent=True,
                                timeout=(ADMIN_TIMEOUT if timeout is None else float(timeout)) + 30.0))

    def drain_status(self) -> Any:
        return self._send(Call("GET", "/drain", idempotent=True, timeout=PROBE_TIMEOUT))

    def undrain(self) -> Any:
        return self._send(Call("DELETE", "/drain", idempotent=True, timeout=PROBE_TIMEOUT * 3))

    def _probe(self, path: str, plane: str = _OPEN) -> Any:
        return self._send(Call("GET", path, plane, idempotent=True, timeout=PROBE_TIMEOUT))

    def health(self) -> Any:
        return self._probe("/health")

    def liveness(self) -> Any:
        return self._probe("/liveness")

    def ready(self) -> Any:
        return self._probe("/ready")

    def server_info(self) -> Any:
        return self._probe("/server_info", _ADMIN)

    def models(self) -> Any:
        return self._probe("/v1/models", _DATA)

    def version(self) -> Any:
        return self._probe("/version")

    def metrics(self) -> Any:
        """``GET /metrics``: the Prometheus text."""
        return self._send(Call("GET", "/metrics", _OPEN, idempotent=True, timeout=PROBE_TIMEOUT,
                                parse=lambda r: r.text))

    def _not_healthy(self, e: TitoError, timeout: float) -> TitoError:
        return TitoError(e.status, f"not healthy after {timeout:g}s: {e.message}", error=e.error, body=e.body,
                         method="GET", path="/health")
