"""Python client for a tito server: ``AsyncTitoClient`` (asyncio) and ``TitoClient`` (blocking), on httpx.

Importing this module pulls in httpx and the standard library only (never vLLM or torch), so a trainer process pays
nothing for it::

    from app.client import TitoClient

    with TitoClient("http://127.0.0.1:8000") as c:
        out = c.generate([1, 2, 3], max_tokens=8, temperature=0, logprobs=1)
        print(out.token_ids, out.logprobs)
        with c.paused():  # resumed when the block ends, also when it raises
            c.update_weights("models/tiny-qwen3", weight_version="step_1")

Every method has a timeout. Calls that are safe to repeat (reads, pause/resume, drain/undrain, abort, LoRA load under
a fixed name on Prime-RL's route) are retried with exponential backoff on connection errors and 502/504; calls that
are not (generation, weight updates, the NCCL handshake, vLLM's ``/v1/load_lora_adapter``) are retried only when the
connection was never made, so the server cannot have seen them. Every failure is raised as ``TitoError``, carrying
the server's error envelope.

Both clients have the same methods (``app.client.wire.Routes`` builds every request and parses every answer); the
two classes here only send: ``AsyncTitoClient``'s methods are awaited.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import httpx

from app.client.wire import (
    ADMIN_TIMEOUT,
    Call,
    Choice,
    GenerateOptions,
    GenerateResult,
    Routes,
    StreamDelta,
    TitoError,
    Usage,
    error_from_response,
    image_parts,
    sse_event,
    stream_deltas,
    transport_error,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "AsyncTitoClient",
    "Choice",
    "GenerateOptions",
    "GenerateResult",
    "StreamDelta",
    "TitoClient",
    "TitoError",
    "Usage",
    "image_parts",
]

DEFAULT_URL = "http://127.0.0.1:8000"


class AsyncTitoClient(Routes):
    """asyncio client. Use as ``async with AsyncTitoClient(url) as c: ...`` or call ``aclose()``; every route method
    (``pause``, ``load_lora``, ``health``, ...) is awaited."""

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

    async def _send(self, call: Call) -> Any:
        attempt = 0
        while True:
            try:
                resp = await self._http.request(**self._request_args(call))
            except httpx.HTTPError as e:
                await asyncio.sleep(self._retry_delay(call, attempt, e))
            else:
                if resp.status_code < 400:
                    return call.parse(resp)
                await asyncio.sleep(self._retry_delay(call, attempt, resp))
            attempt += 1

    @asynccontextmanager
    async def paused(self, mode: str = "keep", clear_cache: bool = False, *,
                     lease: float | None = None) -> AsyncIterator[None]:
        """``async with c.paused(): await c.update_weights(...)``: pause, run the block, resume, also when the block
        raises (then a failed resume is noted on the block's error, which is the one raised)."""
        await self.pause(mode, clear_cache, lease=lease)
        try:
            yield
        except BaseException as e:
            try:
                await self.resume()
            except TitoError as r:
                e.add_note(f"resuming after it failed too: {r}")
            raise
        await self.resume()

    async def generate(self, token_ids: list[int], sampling_params: dict[str, Any] | None = None,
                       **kw: Unpack[GenerateOptions]) -> GenerateResult:
        """``POST /inference/v1/generate``. Keyword sampling arguments override ``sampling_params``."""
        result: GenerateResult = await self._send(self._generate_call(token_ids, sampling_params, stream=False, **kw))
        return result

    async def generate_stream(self, token_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                              include_usage: bool = False,
                              **kw: Unpack[GenerateOptions]) -> AsyncIterator[StreamDelta]:
        """Streamed generation: an async iterator of ``StreamDelta`` (new tokens per event). Breaking out of the
        loop closes the connection, which makes the server abort the request."""
        call = self._generate_call(token_ids, sampling_params, stream=True, include_usage=include_usage, **kw)
        args = self._request_args(call)
        try:
            async with self._http.stream(args.pop("method"), args.pop("url"), **args) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise error_from_response(resp, call.method, call.path)
                async for line in resp.aiter_lines():
                    event = sse_event(line, call.method, call.path)
                    if event is not None:
                        for d in stream_deltas(event):
                            yield d
        except httpx.HTTPError as e:
            raise transport_error(e, call) from e

    async def wait_healthy(self, timeout: float = 600.0, interval: float = 0.5) -> Any:
        """Poll ``/health`` until it answers 200; ``TitoError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await self.health()
            except TitoError as e:
                if time.monotonic() >= deadline:
                    raise self._not_healthy(e, timeout) from e
            await asyncio.sleep(interval)


class TitoClient(Routes):
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

    def _send(self, call: Call) -> Any:
        attempt = 0
        while True:
            try:
                resp = self._http.request(**self._request_args(call))
            except httpx.HTTPError as e:
                time.sleep(self._retry_delay(call, attempt, e))
            else:
                if resp.status_code < 400:
                    return call.parse(resp)
                time.sleep(self._retry_delay(call, attempt, resp))
            attempt += 1

    @contextmanager
    def paused(self, mode: str = "keep", clear_cache: bool = False, *, lease: float | None = None) -> Iterator[None]:
        """``with c.paused(): c.update_weights(...)``: pause, run the block, resume, also when the block raises (then
        a failed resume is noted on the block's error, which is the one raised). ``lease``: see ``pause``."""
        self.pause(mode, clear_cache, lease=lease)
        try:
            yield
        except BaseException as e:
            try:
                self.resume()
            except TitoError as r:
                e.add_note(f"resuming after it failed too: {r}")
            raise
        self.resume()

    def generate(self, token_ids: list[int], sampling_params: dict[str, Any] | None = None,
                 **kw: Unpack[GenerateOptions]) -> GenerateResult:
        """``POST /inference/v1/generate``. Keyword sampling arguments override ``sampling_params``."""
        result: GenerateResult = self._send(self._generate_call(token_ids, sampling_params, stream=False, **kw))
        return result

    def generate_stream(self, token_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                        include_usage: bool = False, **kw: Unpack[GenerateOptions]) -> Iterator[StreamDelta]:
        """Streamed generation: an iterator of ``StreamDelta``; closing it early makes the server abort."""
        call = self._generate_call(token_ids, sampling_params, stream=True, include_usage=include_usage, **kw)
        args = self._request_args(call)
        try:
            with self._http.stream(args.pop("method"), args.pop("url"), **args) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise error_from_response(resp, call.method, call.path)
                for line in resp.iter_lines():
                    event = sse_event(line, call.method, call.path)
                    if event is not None:
                        yield from stream_deltas(event)
        except httpx.HTTPError as e:
            raise transport_error(e, call) from e

    def wait_healthy(self, timeout: float = 600.0, interval: float = 0.5) -> Any:
        """Poll ``/health`` until it answers 200; ``TitoError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.health()
            except TitoError as e:
                if time.monotonic() >= deadline:
                    raise self._not_healthy(e, timeout) from e
            time.sleep(interval)
