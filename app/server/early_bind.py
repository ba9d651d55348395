"""The port answers first: ``tito serve`` binds its port before anything imports vLLM (its argument parser is vLLM's:
seconds of imports), and a thread answers every request 503 "starting" until the server's own app takes the socket
over; then the app says "starting" itself while the engine starts (app/server/startup.py).

The answers are the app's own while it starts (routers/health.py, ``not_started``): ``/health`` ``{"status":
"starting"}``, ``/ready`` ``{"status": "not_ready", "reason": "starting"}``, ``/liveness`` ``{"status":
"starting", ...}``, anything else "server is starting" in tito's error envelope; each with ``Retry-After: 5``, and
the connection closed. Standard library only, imported before anything else of tito's.

The address comes from the command line and the environment (``--host``, ``--port``, ``TITO_HOST``, ``TITO_PORT``,
tito's defaults) read without vLLM's parser; the full parse later must agree, or the socket is closed and the server
binds the address the parse found. No early answer with TLS (the thread speaks plain HTTP: connections wait in the
backlog for the app instead) nor for ``--help``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
from collections.abc import Mapping

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000  # tito's (app/core/settings.py; a unit test holds them equal)
BACKLOG = 2048  # uvicorn's
READ_TIMEOUT_S = 1.0
_STARTING = "server is starting"
BODIES = {
    "/health": {"status": "starting"},
    "/ready": {"status": "not_ready", "reason": "starting"},
    "/liveness": {"status": "starting", "error": _STARTING},
}
ERROR = {"error": {"message": _STARTING, "type": "ServiceUnavailableError", "param": None, "code": 503}}


def _option(argv: list[str], name: str) -> str | None:
    """The last value of ``--name`` (``--name V`` or ``--name=V``, vLLM's ``_`` spelling too)."""
    spellings = {name, name.replace("-", "_")}
    found = None
    for i, a in enumerate(argv):
        key, eq, value = a.partition("=")
        if key in spellings:
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return found


def address(argv: list[str], env: Mapping[str, str]) -> tuple[str, int] | None:
    """Where ``tito serve ARGV`` will listen, or None when this cannot be known yet (or should not be bound early)."""
    if any(a in ("-h", "--help") or a.startswith("--help=") for a in argv):
        return None
    if any(_option(argv, f) for f in ("--ssl-keyfile", "--ssl-certfile", "--uds", "--config")):
        return None  # TLS; a Unix socket (refused later); a config file may set the address
    host = _option(argv, "--host") or env.get("TITO_HOST") or DEFAULT_HOST
    port = _option(argv, "--port") or env.get("TITO_PORT") or str(DEFAULT_PORT)
    try:
        return host, int(port)
    except ValueError:
        return None  # vLLM's parser says why


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket, as uvicorn binds one (``SO_REUSEADDR``). Raises ``OSError`` (the port is taken)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def answer(path: str) -> bytes:
    body = json.dumps(BODIES.get(path, ERROR), separators=(",", ":")).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 5\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))


class Early:
    """The socket bound at launch and the thread answering on it until ``take``."""

    def __init__(self, sock: socket.socket, where: tuple[str, int]) -> None:
        self.sock, self.where = sock, where
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tito-starting", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self.sock], [], [], 0.05)
                if not ready or self._stop.is_set():
                    continue
                self.sock.setblocking(False)
                try:
                    conn, _ = self.sock.accept()
                finally:
                    self.sock.setblocking(True)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return  # the socket was closed under us
            with conn:
                self._reply(conn)

    def _reply(self, conn: socket.socket) -> None:
        conn.settimeout(READ_TIMEOUT_S)
        data = b""
        with contextlib.suppress(OSError, ValueError):
            while b"\r\n\r\n" not in data and len(data) < 65536:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            parts = lines[0].split(b" ")
            path = parts[1].split(b"?", 1)[0].decode("latin-1") if len(parts) > 1 else ""
            # Read a small body to its end: closing with unread bytes would reset the connection, and the client
            # could lose the answer.
            length = next((int(v) for k, _, v in (ln.partition(b":") for ln in lines[1:])
                           if k.strip().lower() == b"content-length"), 0)
            while len(body) < min(length, 1 << 20):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                body += chunk
            conn.sendall(answer(path))
            conn.shutdown(socket.SHUT_WR)

    def stop(self) -> None:
        """The app takes the socket from here: no answer of this thread's after this returns."""
        self._stop.set()
        self._thread.join()

    def take(self, host: str, port: int) -> socket.socket | None:
        """Stop answering; the socket, if it is the one the server wants (``host``, ``port``), else None (closed)."""
        self.stop()
        if (host, port) == self.where:
            return self.sock
        self.sock.close()
        return None

    def close(self) -> None:
        self.stop()
        self.sock.close()


def open_early(argv: list[str], env: Mapping[str, str] | None = None) -> Early | None:
    """Bind and answer "starting" now, when the address is known. Raises ``OSError`` when it cannot be bound (the
    port is taken: the server could not start either)."""
    where = address(argv, os.environ if env is None else env)
    if where is None:
        return None
    try:
        sock = bind(*where)
    except socket.gaierror:
        return None  # not an address: the server's own start says so
    return Early(sock, where)
