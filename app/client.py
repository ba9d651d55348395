"""Python client for a tito server: ``AsyncTitoClient`` (asyncio) and ``TitoClient`` (blocking), on httpx.

Importing this module pulls in httpx and the standard library only (never vLLM or torch), so a trainer process pays
nothing for it::

    from app.client import TitoClient

    with TitoClient("http://127.0.0.1:8000") as c:
        out = c.generate([1, 2, 3], max_tokens=8, temperature=0, logprobs=1)
        print(out.token_ids, out.logprobs)

Every method has a timeout. Calls that are safe to repeat (reads, pause/resume, drain/undrain, abort, LoRA load under
a fixed name) are retried with exponential backoff on connection errors and 502/504; calls that are not
(generation, weight updates, the NCCL handshake) are retried only when the connection was never made, so the server
cannot have seen them. Every failure is raised as ``TitoError``, carrying the server's error envelope.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = [
    "AsyncTitoClient",
    "Choice",
    "GenerateResult",
    "StreamDelta",
    "TitoClient",
    "TitoError",
    "Usage",
]

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


def _error_from_response(resp: httpx.Response, method: str, path: str) -> TitoError:
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


def _deltas(event: dict[str, Any]) -> list[StreamDelta]:
    rid = event.get("request_id", "")
    usage = Usage.parse(event.get("usage"))
    choices = event.get("choices") or []
    if not choices:
        return [StreamDelta(rid, -1, [], None, None, usage, event)]
    return [StreamDelta(rid, int(c.get("index", 0)), list(c.get("token_ids") or []), _logprob_values(c.get("logprobs")),
                        c.get("finish_reason"), usage, event) for c in choices]


def _sse_event(line: str, method: str, path: str) -> dict[str, Any] | None:
    """Parse one SSE line; None for blank lines, comments and ``[DONE]``; raise on an error event."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    event = json.loads(payload)
    if isinstance(event, dict) and isinstance(event.get("error"), dict):
        env = event["error"]
        raise TitoError(int(env.get("code") or 500), str(env.get("message", "")), error=env, body=event,
                        method=method, path=path)
    return event


# --------------------------------------------------------------------------------------------------- calls

_DATA, _ADMIN, _OPEN = "data", "admin", "open"


@dataclass
class _Call:
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


def image_parts(images: list[Any]) -> list[dict[str, str]]:
    """``content_parts`` for images given as file paths, raw bytes or URLs (``data:``/``http(s):``/``file:``):
    paths and bytes are sent inline as data URLs, which any tito server takes."""
    import base64
    import mimetypes
    from pathlib import Path

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


def _bool(v: bool) -> str:
    return "true" if v else "false"


def _sampling(sampling_params: dict[str, Any] | None, kw: dict[str, Any]) -> dict[str, Any]:
    sp = dict(sampling_params or {})
    sp.update({k: v for k, v in kw.items() if v is not None})
    return sp


class _Spec:
    """Builds the ``_Call`` of every route. Subclasses add the transport."""

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

    def _auth(self, plane: str) -> dict[str, str]:
        key = self.api_key if plane == _DATA else (self.admin_api_key or self.api_key) if plane == _ADMIN else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _generate_call(self, token_ids: list[int], sampling_params: dict[str, Any] | None, *, stream: bool,
                       request_id: str | None, model: str | None, cache_salt: str | None, priority: int | None,
                       return_token_ids: bool | None, data_parallel_rank: int | None, include_usage: bool,
                       extra: dict[str, Any] | None, timeout: float | None, sp_kw: dict[str, Any]) -> _Call:
        body: dict[str, Any] = {"token_ids": list(token_ids), "sampling_params": _sampling(sampling_params, sp_kw)}
        for k, v in (("request_id", request_id), ("model", model), ("cache_salt", cache_salt),
                     ("priority", priority), ("return_token_ids", return_token_ids)):
            if v is not None:
                body[k] = v
        if stream:
            body["stream"] = True
            if include_usage:
                body["stream_options"] = {"include_usage": True}
        body.update(extra or {})
        headers = {"X-data-parallel-rank": str(data_parallel_rank)} if data_parallel_rank is not None else None
        return _Call("POST", "/inference/v1/generate", _DATA, json=body, headers=headers,
                     timeout=GENERATE_TIMEOUT if timeout is None else timeout,
                     parse=lambda r: GenerateResult.parse(r.json()))

    # Admin and probe calls, in route order. Answers are the server's JSON as a dict.

    def _abort(self, request_ids: list[str] | str | None) -> _Call:
        if request_ids is None:
            body: dict[str, Any] = {}  # every request in flight
        else:
            body = {"request_ids": [request_ids] if isinstance(request_ids, str) else list(request_ids)}
        return _Call("POST", "/abort_requests", json=body, idempotent=True, timeout=PROBE_TIMEOUT * 3)

    def _pause(self, mode: str, clear_cache: bool, timeout: float | None) -> _Call:
        return _Call("POST", "/pause", params={"mode": mode, "clear_cache": _bool(clear_cache)}, idempotent=True,
                     timeout=timeout or ADMIN_TIMEOUT)

    def _resume(self) -> _Call:
        return _Call("POST", "/resume", idempotent=True)

    def _is_paused(self) -> _Call:
        return _Call("GET", "/is_paused", idempotent=True, timeout=PROBE_TIMEOUT,
                     parse=lambda r: bool(r.json()["is_paused"]))

    def _update_weights(self, weight_dir: str | None, weight_version: str | None, timeout: float | None) -> _Call:
        body: dict[str, Any] = {"weight_dir": None if weight_dir is None else str(weight_dir)}
        if weight_version is not None:
            body["weight_version"] = weight_version
        # Not idempotent: a repeated NCCL update would wait for a broadcast that never comes.
        return _Call("POST", "/update_weights", json=body, timeout=timeout or UPDATE_WEIGHTS_TIMEOUT)

    def _init_broadcaster(self, host: str, port: int, rank_offset: int, inference_world_size: int,
                          timeout: float, extra: dict[str, Any] | None) -> _Call:
        body = {"host": host, "port": port, "rank_offset": rank_offset, "inference_world_size": inference_world_size,
                "timeout": timeout, **(extra or {})}
        # The server blocks until the group forms (up to ``timeout``); give the answer some slack beyond that.
        return _Call("POST", "/init_broadcaster", json=body, timeout=float(timeout) + 30.0)

    def _load_lora(self, name: str, path: str, v1: bool) -> _Call:
        # Same name, same path → same adapter (reloaded in place): safe to repeat.
        return _Call("POST", "/v1/load_lora_adapter" if v1 else "/load_lora_adapter",
                     json={"lora_name": name, "lora_path": str(path)}, idempotent=True, timeout=120.0)

    def _unload_lora(self, name: str) -> _Call:
        return _Call("POST", "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60.0)

    def _drain(self, timeout: float | None) -> _Call:
        body = {} if timeout is None else {"timeout": timeout}
        return _Call("POST", "/drain", json=body, idempotent=True,
                     timeout=(ADMIN_TIMEOUT if timeout is None else float(timeout)) + 30.0)

    def _drain_status(self) -> _Call:
        return _Call("GET", "/drain", idempotent=True, timeout=PROBE_TIMEOUT)

    def _undrain(self) -> _Call:
        return _Call("DELETE", "/drain", idempotent=True, timeout=PROBE_TIMEOUT * 3)

    def _probe(self, path: str, plane: str = _OPEN) -> _Call:
        return _Call("GET", path, plane, idempotent=True, timeout=PROBE_TIMEOUT)

    def _metrics(self) -> _Call:
        return _Call("GET", "/metrics", _OPEN, idempotent=True, timeout=PROBE_TIMEOUT, parse=lambda r: r.text)

    def _delay(self, attempt: int) -> float:
        return min(self.backoff * (2 ** attempt), 5.0) * (0.5 + random.random() / 2)

    def _should_retry(self, call: _Call, attempt: int, exc: Exception | None, status: int | None) -> bool:
        if attempt >= self.retries:
            return False
        if exc is not None:
            # Nothing was sent when the connection could not be made: any call may go again.
            if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                return True
            return call.idempotent and isinstance(exc, httpx.TransportError)
        return call.idempotent and status in _RETRY_STATUS

    def _timeout(self, call: _Call) -> httpx.Timeout:
        read = call.timeout if call.timeout is not None else self.timeout
        return httpx.Timeout(read, connect=min(10.0, read))

    def _headers(self, call: _Call) -> dict[str, str]:
        h = self._auth(call.plane)
        if call.headers:
            h.update(call.headers)
        return h


def _transport_error(exc: Exception, call: _Call) -> TitoError:
    kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
    return TitoError(0, f"request {kind}: {type(exc).__name__}: {exc}", method=call.method, path=call.path)


# --------------------------------------------------------------------------------------------------- async


class AsyncTitoClient(_Spec):
    """asyncio client. Use as ``async with AsyncTitoClient(url) as c: ...`` or call ``aclose()``."""

    def __init__(self, base_url: str = DEFAULT_URL, *, api_key: str | None = None, admin_api_key: str | None = None,
                 timeout: float = ADMIN_TIMEOUT, retries: int = 3, backoff: float = 0.25,
                 max_connections: int = 1000, transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(base_url, api_key, admin_api_key, timeout, retries, backoff)
        self._http = httpx.AsyncClient(base_url=self.base_url, transport=transport,
                                       limits=httpx.Limits(max_connections=max_connections,
                                                           max_keepalive_connections=max_connections),
                                       timeout=httpx.Timeout(timeout, connect=10.0))

    async def __aenter__(self) -> AsyncTitoClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: _Call) -> Any:
        attempt = 0
        while True:
            try:
                resp = await self._http.request(call.method, call.path, json=call.json, params=call.params,
                                                headers=self._headers(call), timeout=self._timeout(call))
            except httpx.HTTPError as e:
                if self._should_retry(call, attempt, e, None):
                    await asyncio.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise _transport_error(e, call) from e
            if resp.status_code >= 400:
                if self._should_retry(call, attempt, None, resp.status_code):
                    await asyncio.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise _error_from_response(resp, call.method, call.path)
            return call.parse(resp)

    async def generate(self, token_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                       max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                       top_k: int | None = None, seed: int | None = None, n: int | None = None,
                       logprobs: int | None = None, prompt_logprobs: int | None = None,
                       stop_token_ids: list[int] | None = None, ignore_eos: bool | None = None,
                       request_id: str | None = None, model: str | None = None, cache_salt: str | None = None,
                       priority: int | None = None, return_token_ids: bool | None = None,
                       data_parallel_rank: int | None = None, extra: dict[str, Any] | None = None,
                       timeout: float | None = None, images: list[Any] | None = None) -> GenerateResult:
        """``POST /inference/v1/generate``. Keyword sampling arguments override ``sampling_params``. ``images``
        (paths, bytes or URLs) go as ``content_parts``: ``token_ids`` then hold one image token per image."""
        extra = {**(extra or {}), "content_parts": image_parts(images)} if images else extra
        sp_kw = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, n=n,
                     logprobs=logprobs, prompt_logprobs=prompt_logprobs, stop_token_ids=stop_token_ids,
                     ignore_eos=ignore_eos)
        call = self._generate_call(token_ids, sampling_params, stream=False, request_id=request_id, model=model,
                                   cache_salt=cache_salt, priority=priority, return_token_ids=return_token_ids,
                                   data_parallel_rank=data_parallel_rank, include_usage=False, extra=extra,
                                   timeout=timeout, sp_kw=sp_kw)
        return await self._send(call)

    async def generate_stream(self, token_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                              max_tokens: int | None = None, temperature: float | None = None,
                              top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                              n: int | None = None, logprobs: int | None = None,
                              stop_token_ids: list[int] | None = None, ignore_eos: bool | None = None,
                              request_id: str | None = None, model: str | None = None,
                              cache_salt: str | None = None, priority: int | None = None,
                              include_usage: bool = False, data_parallel_rank: int | None = None,
                              extra: dict[str, Any] | None = None,
                              timeout: float | None = None) -> AsyncIterator[StreamDelta]:
        """Streamed generation: an async iterator of ``StreamDelta`` (new tokens per event). Breaking out of the
        loop closes the connection, which makes the server abort the request."""
        sp_kw = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, n=n,
                     logprobs=logprobs, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        call = self._generate_call(token_ids, sampling_params, stream=True, request_id=request_id, model=model,
                                   cache_salt=cache_salt, priority=priority, return_token_ids=None,
                                   data_parallel_rank=data_parallel_rank, include_usage=include_usage, extra=extra,
                                   timeout=timeout, sp_kw=sp_kw)
        try:
            async with self._http.stream(call.method, call.path, json=call.json, headers=self._headers(call),
                                         timeout=self._timeout(call)) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise _error_from_response(resp, call.method, call.path)
                async for line in resp.aiter_lines():
                    event = _sse_event(line, call.method, call.path)
                    if event is not None:
                        for d in _deltas(event):
                            yield d
        except httpx.HTTPError as e:
            raise _transport_error(e, call) from e

    async def abort(self, request_ids: list[str] | str | None) -> Any:
        """``POST /abort_requests``: abort by the client's ids or the answered ``generate-tokens-<id>``; None aborts
        every request in flight. Aborted requests still answer, with ``finish_reason == "abort"``."""
        return await self._send(self._abort(request_ids))

    async def pause(self, mode: str = "keep", clear_cache: bool = False, timeout: float | None = None) -> Any:
        """``POST /pause``: ``keep`` parks in-flight requests, ``wait`` lets them finish, ``abort`` ends them."""
        return await self._send(self._pause(mode, clear_cache, timeout))

    async def resume(self) -> Any:
        return await self._send(self._resume())

    async def is_paused(self) -> bool:
        return bool(await self._send(self._is_paused()))

    async def update_weights(self, weight_dir: str | None, weight_version: str | None = None,
                             timeout: float | None = None) -> Any:
        """``POST /update_weights``: load HF safetensors from ``weight_dir`` (None: take the NCCL broadcast)."""
        return await self._send(self._update_weights(weight_dir, weight_version, timeout))

    async def init_broadcaster(self, host: str, port: int, rank_offset: int, inference_world_size: int,
                               timeout: float = 1200.0, extra: dict[str, Any] | None = None) -> Any:
        """``POST /init_broadcaster``: join the trainer's weight-broadcast group (blocks until it forms)."""
        return await self._send(self._init_broadcaster(host, port, rank_offset, inference_world_size, timeout, extra))

    async def load_lora(self, name: str, path: str, *, v1: bool = False) -> Any:
        """Load (or reload in place, same name) a PEFT adapter; ``v1=True`` uses vLLM's ``/v1/`` route."""
        return await self._send(self._load_lora(name, str(path), v1))

    async def unload_lora(self, name: str) -> Any:
        return await self._send(self._unload_lora(name))

    async def drain(self, timeout: float | None = None) -> Any:
        """``POST /drain``: refuse new generations and wait up to ``timeout`` s for in-flight ones to finish."""
        return await self._send(self._drain(timeout))

    async def drain_status(self) -> Any:
        return await self._send(self._drain_status())

    async def undrain(self) -> Any:
        return await self._send(self._undrain())

    async def health(self) -> Any:
        return await self._send(self._probe("/health"))

    async def liveness(self) -> Any:
        return await self._send(self._probe("/liveness"))

    async def ready(self) -> Any:
        return await self._send(self._probe("/ready"))

    async def server_info(self) -> Any:
        return await self._send(self._probe("/server_info", _ADMIN))

    async def models(self) -> Any:
        return await self._send(self._probe("/v1/models", _DATA))

    async def version(self) -> Any:
        return await self._send(self._probe("/version"))

    async def metrics(self) -> str:
        return str(await self._send(self._metrics()))

    async def wait_healthy(self, timeout: float = 600.0, interval: float = 0.5) -> Any:
        """Poll ``/health`` until it answers 200; ``TitoError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await self.health()
            except TitoError as e:
                if time.monotonic() >= deadline:
                    raise TitoError(e.status, f"not healthy after {timeout:g}s: {e.message}", error=e.error,
                                    body=e.body, method="GET", path="/health") from e
            await asyncio.sleep(interval)


# --------------------------------------------------------------------------------------------------- blocking


class TitoClient(_Spec):
    """Blocking client with the same methods as ``AsyncTitoClient``; ``generate_stream`` is a plain iterator."""

    def __init__(self, base_url: str = DEFAULT_URL, *, api_key: str | None = None, admin_api_key: str | None = None,
                 timeout: float = ADMIN_TIMEOUT, retries: int = 3, backoff: float = 0.25,
                 transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(base_url, api_key, admin_api_key, timeout, retries, backoff)
        self._http = httpx.Client(base_url=self.base_url, transport=transport,
                                  timeout=httpx.Timeout(timeout, connect=10.0))

    def __enter__(self) -> TitoClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: _Call) -> Any:
        attempt = 0
        while True:
            try:
                resp = self._http.request(call.method, call.path, json=call.json, params=call.params,
                                          headers=self._headers(call), timeout=self._timeout(call))
            except httpx.HTTPError as e:
                if self._should_retry(call, attempt, e, None):
                    time.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise _transport_error(e, call) from e
            if resp.status_code >= 400:
                if self._should_retry(call, attempt, None, resp.status_code):
                    time.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise _error_from_response(resp, call.method, call.path)
            return call.parse(resp)

    def generate(self, token_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                 max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, seed: int | None = None, n: int | None = None,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 stop_token_ids: list[int] | None = None, ignore_eos: bool | None = None,
                 request_id: str | None = None, model: str | None = None, cache_salt: str | None = None,
                 priority: int | None = None, return_token_ids: bool | None = None,
                 data_parallel_rank: int | None = None, extra: dict[str, Any] | None = None,
                 timeout: float | None = None, images: list[Any] | None = None) -> GenerateResult:
        extra = {**(extra or {}), "content_parts": image_parts(images)} if images else extra
        sp_kw = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, n=n,
                     logprobs=logprobs, prompt_logprobs=prompt_logprobs, stop_token_ids=stop_token_ids,
                     ignore_eos=ignore_eos)
        call = self._generate_call(token_ids, sampling_params, stream=False, request_id=request_id, model=model,
                                   cache_salt=cache_salt, priority=priority, return_token_ids=return_token_ids,
                                   data_parallel_rank=data_parallel_rank, include_usage=False, extra=extra,
                                   timeout=timeout, sp_kw=sp_kw)
        result: GenerateResult = self._send(call)
        return result

    def generate_stream(self, token_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                        max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                        top_k: int | None = None, seed: int | None = None, n: int | None = None,
                        logprobs: int | None = None, stop_token_ids: list[int] | None = None,
                        ignore_eos: bool | None = None, request_id: str | None = None, model: str | None = None,
                        cache_salt: str | None = None, priority: int | None = None, include_usage: bool = False,
                        data_parallel_rank: int | None = None, extra: dict[str, Any] | None = None,
                        timeout: float | None = None) -> Iterator[StreamDelta]:
        sp_kw = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, n=n,
                     logprobs=logprobs, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        call = self._generate_call(token_ids, sampling_params, stream=True, request_id=request_id, model=model,
                                   cache_salt=cache_salt, priority=priority, return_token_ids=None,
                                   data_parallel_rank=data_parallel_rank, include_usage=include_usage, extra=extra,
                                   timeout=timeout, sp_kw=sp_kw)
        try:
            with self._http.stream(call.method, call.path, json=call.json, headers=self._headers(call),
                                   timeout=self._timeout(call)) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise _error_from_response(resp, call.method, call.path)
                for line in resp.iter_lines():
                    event = _sse_event(line, call.method, call.path)
                    if event is not None:
                        yield from _deltas(event)
        except httpx.HTTPError as e:
            raise _transport_error(e, call) from e

    def abort(self, request_ids: list[str] | str | None) -> Any:
        return self._send(self._abort(request_ids))

    def pause(self, mode: str = "keep", clear_cache: bool = False, timeout: float | None = None) -> Any:
        return self._send(self._pause(mode, clear_cache, timeout))

    def resume(self) -> Any:
        return self._send(self._resume())

    def is_paused(self) -> bool:
        return bool(self._send(self._is_paused()))

    def update_weights(self, weight_dir: str | None, weight_version: str | None = None,
                       timeout: float | None = None) -> Any:
        return self._send(self._update_weights(weight_dir, weight_version, timeout))

    def init_broadcaster(self, host: str, port: int, rank_offset: int, inference_world_size: int,
                         timeout: float = 1200.0, extra: dict[str, Any] | None = None) -> Any:
        return self._send(self._init_broadcaster(host, port, rank_offset, inference_world_size, timeout, extra))

    def load_lora(self, name: str, path: str, *, v1: bool = False) -> Any:
        return self._send(self._load_lora(name, str(path), v1))

    def unload_lora(self, name: str) -> Any:
        return self._send(self._unload_lora(name))

    def drain(self, timeout: float | None = None) -> Any:
        return self._send(self._drain(timeout))

    def drain_status(self) -> Any:
        return self._send(self._drain_status())

    def undrain(self) -> Any:
        return self._send(self._undrain())

    def health(self) -> Any:
        return self._send(self._probe("/health"))

    def liveness(self) -> Any:
        return self._send(self._probe("/liveness"))

    def ready(self) -> Any:
        return self._send(self._probe("/ready"))

    def server_info(self) -> Any:
        return self._send(self._probe("/server_info", _ADMIN))

    def models(self) -> Any:
        return self._send(self._probe("/v1/models", _DATA))

    def version(self) -> Any:
        return self._send(self._probe("/version"))

    def metrics(self) -> str:
        return str(self._send(self._metrics()))

    def wait_healthy(self, timeout: float = 600.0, interval: float = 0.5) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.health()
            except TitoError as e:
                if time.monotonic() >= deadline:
                    raise TitoError(e.status, f"not healthy after {timeout:g}s: {e.message}", error=e.error,
                                    body=e.body, method="GET", path="/health") from e
            time.sleep(interval)
