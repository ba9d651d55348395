"""HTTP between the processes of one server, over their private Unix sockets: an API process hands a server-wide call
to the control process (``forward``), the control process asks the API processes for what only they know
(``call``: abort their requests, count them). See app/server/api_processes.py for who calls what.

A forwarded request is passed on as the client sent it (method, path, query, headers, body, streamed both ways);
the control process runs it through the same app (key checks, body limit, routes) and its answer comes back as it
wrote it. One Unix-socket round trip on a kept-alive connection: the control process's event loop serves no
generation, so the call waits behind none.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
from starlette.types import Message, Receive, Scope, Send

from app.core.protocol import ApiError, send_api_error

log = logging.getLogger("tito.forward")

# The header an API process adds to a request it forwards: "<secret> <its index> <client host> <client port>" (the
# control process honours it only with the server's own secret, and logs the client's address from it).
FORWARDED = b"x-tito-forwarded"
# The header of the control process's own calls into an API process ("<secret>"): served there, never forwarded.
INTERNAL = b"x-tito-internal"
# Hop-by-hop headers (RFC 9110 section 7.6.1) and the body framing, which each hop sets for itself.
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade",
                  b"transfer-encoding", b"content-length", b"expect", FORWARDED, INTERNAL})
_IDLE_KEPT = 8
_READ = 1 << 16


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class Unreachable(Exception):
    """The other process did not take the request (not listening yet, or gone): nothing of it was run."""


class UdsClient:
    """Kept-alive HTTP/1.1 connections to one process's Unix socket."""

    def __init__(self, path: str, tls: bool = False) -> None:
        """``tls``: the process behind ``path`` serves TLS there too (an API process of a server started with
        vLLM's TLS arguments): the socket is private to the server, so its certificate is not checked."""
        self.path = path
        self._idle: list[_Conn] = []
        self._tls: ssl.SSLContext | None = None
        if tls:
            self._tls = ssl.create_default_context()
            self._tls.check_hostname = False
            self._tls.verify_mode = ssl.CERT_NONE

    async def _connect(self) -> tuple[_Conn, bool]:
        """A connection, and whether it was reused (a reused one may have been closed by the other side since)."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn, True
            conn.close()
        try:
            reader, writer = await asyncio.open_unix_connection(
                self.path, limit=_READ, ssl=self._tls, server_hostname="tito" if self._tls else None)
        except OSError as e:
            raise Unreachable(str(e)) from None
        return _Conn(reader, writer), False

    def _release(self, conn: _Conn, keep: bool) -> None:
        if keep and len(self._idle) < _IDLE_KEPT:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def exchange(self, head: bytes, body: Callable[[asyncio.StreamWriter], Awaitable[None]] | bytes,
                       on_head: Callable[[int, list[tuple[bytes, bytes]]], Awaitable[None]],
                       on_body: Callable[[bytes, bool], Awaitable[None]], head_only: bool = False) -> None:
        """Send one request (``head``, then ``body``: bytes, or a coroutine writing it) and hand its answer to
        ``on_head(status, headers)`` and ``on_body(chunk, more)``. Raises ``Unreachable`` when the request could not
        be delivered (nothing of it ran: on a stale kept-alive connection it is retried once on a new one)."""
        for attempt in (0, 1):
            conn, reused = await self._connect()
            try:
                conn.writer.write(head)
                if isinstance(body, bytes):
                    conn.writer.write(body)
                else:
                    await body(conn.writer)
                await conn.writer.drain()
                first = await conn.reader.read(_READ)
            except OSError as e:
                conn.close()
                if reused and attempt == 0:
                    continue
                raise Unreachable(str(e)) from None
            if not first:
                conn.close()
                if reused and attempt == 0:
                    continue  # the other side had closed the idle connection: the request never reached it
                raise Unreachable("connection closed before an answer")
            keep = await _read_answer(conn.reader, first, on_head, on_body, head_only)
            self._release(conn, keep)
            return

    async def call(self, method: str, path: str, payload: Any = None, headers: dict[str, str] | None = None,
                   timeout: float = 30.0) -> tuple[int, Any]:
        """A whole JSON request and answer (the control process's calls into an API process)."""
        data = b"" if payload is None else json.dumps(payload).encode()
        lines = [f"{method} {path} HTTP/1.1", "host: tito", f"content-length: {len(data)}",
                 "content-type: application/json", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        status = 0
        chunks: list[bytes] = []

        async def on_head(code: int, _: list[tuple[bytes, bytes]]) -> None:
            nonlocal status
            status = code

        async def on_body(chunk: bytes, more: bool) -> None:
            chunks.append(chunk)

        await asyncio.wait_for(self.exchange(head, data, on_head, on_body), timeout)
        raw = b"".join(chunks)
        return status, json.loads(raw) if raw else None


async def _read_answer(reader: asyncio.StreamReader, first: bytes,
                       on_head: Callable[[int, list[tuple[bytes, bytes]]], Awaitable[None]],
                       on_body: Callable[[bytes, bool], Awaitable[None]], head_only: bool) -> bool:
    """Parse an HTTP/1.1 answer (uvicorn's: a Content-Length or chunked body) and hand it on; returns whether the
    connection may carry another request."""
    headers: list[tuple[bytes, bytes]] = []
    events: list[tuple[str, bytes]] = []
    keep = [False]

    class Sink:
        def on_header(self, name: bytes, value: bytes) -> None:
            headers.append((name.lower(), value))

        def on_headers_complete(self) -> None:
            events.append(("head", b""))

        def on_body(self, body: bytes) -> None:
            events.append(("body", bytes(body)))

        def on_message_complete(self) -> None:
            keep[0] = bool(parser.should_keep_alive())  # asked now: the parser resets for the next message after
            events.append(("done", b""))

    parser = httptools.HttpResponseParser(Sink())
    data, started = first, False
    while True:
        parser.feed_data(data)
        for kind, chunk in events:
            if kind == "head":
                started = True
                await on_head(parser.get_status_code(), headers)
                if head_only:
                    await on_body(b"", False)
                    return False
            elif kind == "body":
                await on_body(chunk, True)
            else:
                await on_body(b"", False)
                return keep[0]
        events.clear()
        data = await reader.read(_READ)
        if not data:
            raise ConnectionError("the other process closed the connection mid-answer" if started
                                  else "connection closed before an answer")


def _target(scope: Scope) -> bytes:
    path = scope.get("raw_path") or scope["path"].encode()
    qs = scope.get("query_string") or b""
    return path + (b"?" + qs if qs else b"")


async def forward(client: UdsClient, scope: Scope, receive: Receive, send: Send, tag: bytes,
                  unreachable: Callable[[], ApiError]) -> None:
    """Pass an ASGI HTTP request to the process behind ``client`` and its answer back. ``tag``: the
    ``x-tito-forwarded`` value; ``unreachable()``: the answer when that process does not take it."""
    message = await receive()
    body = message.get("body", b"")
    more = message.get("more_body", False)
    given = dict(scope["headers"])
    headers = [(k, v) for k, v in scope["headers"] if k not in _HOP]
    if not more:
        headers.append((b"content-length", b"%d" % len(body)))
    elif b"content-length" in given:
        headers.append((b"content-length", given[b"content-length"]))
    else:
        headers.append((b"transfer-encoding", b"chunked"))
    chunked = more and b"content-length" not in given
    head = b"".join([scope["method"].encode(), b" ", _target(scope), b" HTTP/1.1\r\n",
                     *(k + b": " + v + b"\r\n" for k, v in headers), FORWARDED, b": ", tag, b"\r\n\r\n"])

    async def write_body(writer: asyncio.StreamWriter) -> None:
        nonlocal body, more
        while True:
            if body:
                writer.write(b"%x\r\n%b\r\n" % (len(body), body) if chunked else body)
                await writer.drain()
            if not more:
                break
            msg: Message = await receive()
            if msg["type"] == "http.disconnect":
                raise ConnectionError("client disconnected while sending its body")
            body, more = msg.get("body", b""), msg.get("more_body", False)
        if chunked:
            writer.write(b"0\r\n\r\n")

    started = False

    async def on_head(status: int, answer: list[tuple[bytes, bytes]]) -> None:
        nonlocal started
        started = True
        await send({"type": "http.response.start", "status": status,
                    "headers": [(k, v) for k, v in answer if k not in _HOP or k == b"content-length"]})

    async def on_body(chunk: bytes, more_body: bool) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": more_body})

    try:
        await client.exchange(head, write_body if more else body, on_head, on_body,
                              head_only=scope["method"] == "HEAD")
    except (Unreachable, ConnectionError) as e:
        if started:
            raise
        log.warning("%s %s: %s", scope["method"], scope["path"], e)
        await send_api_error(send, unreachable())
