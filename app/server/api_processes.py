"""``tito serve --api-server-count N`` (N > 1): N API processes on one port, one server.

The processes (N = 2)::

    tito serve ............ the control process: the control plane, gRPC, Dynamo's sidecar; engine client N
    ├── API process 0 ..... ┐ share the listening socket (vLLM's accept balancing: app/engine/api_servers.py),
    ├── API process 1 ..... ┘ each an engine client (0, 1): generation, probes and reads served in place
    ├── EngineCore (one per data-parallel rank) and its worker, the DP coordinator (when DP > 1)
    └── Dynamo's sidecar (--dynamo-namespace)

Where the server-wide state lives: in the control process, in the one ``AppState`` that holds the control plane, the
weight manager, the LoRA registry, staging, drain and shutdown, exactly as a single-process server holds them. An API
process serves the data plane (generation, (de)tokenize), the probes (``/health``, ``/ready``, ``/liveness``),
``/is_paused``, ``/v1/models`` and ``/version`` itself, and passes every other request (pause, resume, weights, LoRA,
staging, drain, abort, ``/server_info``, ``/metrics``, AReaL's routes, anything unknown) to the control process over
a Unix socket, unchanged (app/server/forward.py): so a call through any process takes effect once, in the control
plane's one order, with its guarantees, and is answered by the one process that knows. The control process's event
loop serves no stream: a pause or an update through a busy API process waits behind that process's loop once, to be
passed on, and behind nothing else.

What an API process must know to serve without asking, the control process publishes on the board (shared memory,
app/server/board.py) before its answer leaves and whenever else it changes (checked every 100 ms): readiness,
draining, shutting down, leaving the fleet, the engine's death, inconsistent or unrestored weights, the pause as
tito set it, the LoRA registry, the prefix-cache salt of the current weights, when the server started
(``board_doc``). An API process applies it (``apply_board``) before every admission, when it answers a probe, and
every 50 ms. Requests in flight are counted in the shared slots, so any process knows the whole server's count.

Two things need the API processes themselves, and the control process calls them over their own Unix sockets
(internal routes under ``/_tito/``, honoured only with the server's secret): aborting requests by id or all of them
(each knows only its own), and making sure every one has applied a drain or a shutdown before the control process
waits for the last request (``settle``: after it, no process admits one).

One server, supervised as one: the API processes ignore SIGINT and SIGTERM and die with the control process
(``PR_SET_PDEATHSIG``); SIGTERM to ``tito serve`` drains the whole server (every process refuses new work at once,
in-flight requests everywhere finish, then the rest are aborted) and stops the API processes before the engine; an
API process that dies, or the engine, ends the whole server with exit code 1, never half of it.

How they start: forked from the control process once it has imported vLLM and built the engine configuration, and
before it has started any thread or event loop (nothing is held by another thread in the children); each then makes
its own engine client while the engine cores load. A fork costs no imports: the tiny model's server at N = 2 starts
about as fast as at N = 1. vLLM's ``spawn`` would import vLLM and PyTorch again in every API process (15-20
CPU-seconds each).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.types import Receive, Scope, Send

from app.core.protocol import ApiError, json_response
from app.server.board import FORWARDED as FORWARDED_COUNT
from app.server.board import SEEN, UP, Shared
from app.server.forward import FORWARDED, INTERNAL, UdsClient, Unreachable, forward
from app.server.mirror import apply_board, board_doc
from app.server.state import AppState

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from app.core.settings import Settings
    from app.engine.api_servers import EnginePlan

log = logging.getLogger("tito.api")

# Served by each API process itself; everything else goes to the control process.
LOCAL_PATHS = frozenset({
    "/inference/v1/generate", "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/render", "/tokenize",
    "/detokenize", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
    "/health", "/liveness", "/ready", "/version", "/v1/models", "/is_paused",
    "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
})
INTERNAL_PREFIX = "/_tito/"
SWEEP_S = 0.25  # the control process publishes what changed without a request (a pause lease that ran out)
WATCH_S = 0.2  # an API process looks at the board between requests (the engine's death, the server stopping)
STOP_GRACE_S = 10.0  # an API process asked to stop has this long before it is killed


@dataclass
class Layout:
    """What every process of the server shares, made by the control process before it forks the API processes."""

    processes: int
    shared: Shared
    runtime_dir: str  # private (0700): the Unix sockets
    secret: str  # proves a request came from a process of this server (forwarded and internal calls)
    owner: int  # the control process's pid

    @classmethod
    def make(cls, processes: int) -> Layout:
        return cls(processes, Shared(processes), tempfile.mkdtemp(prefix="tito-api-"), secrets.token_hex(16),
                   os.getpid())

    @property
    def control_socket(self) -> str:
        return os.path.join(self.runtime_dir, "control.sock")

    def api_socket(self, index: int) -> str:
        return os.path.join(self.runtime_dir, f"api-{index}.sock")

    def cleanup(self) -> None:
        if os.getpid() == self.owner:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)


def unix_listener(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(128)
    return sock


def _path(scope: Scope) -> str:
    path: str = scope["path"]
    root = scope.get("root_path") or ""
    return path[len(root):] if root and path.startswith(root) else path


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return bytes(v)
    return None


# ------------------------------------------------------------------------------------------------ control side


class ControlPeers:
    """The control process's side: publishes the board, asks the API processes for what only they know, watches
    them (``AppState.peers`` there)."""

    def __init__(self, layout: Layout, plan: EnginePlan, tls: bool = False) -> None:
        """``tls``: the API processes serve TLS (vLLM's TLS arguments), on their private sockets too."""
        self.layout = layout
        self.plan = plan
        self.slots = layout.shared
        self.slot = layout.processes
        self.processes: list[BaseProcess] = []
        self.clients = [UdsClient(layout.api_socket(i), tls) for i in range(layout.processes)]
        self.extra: dict[str, Any] = {"stop": False}
        self.state: AppState | None = None
        self.stopping = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._internal = {INTERNAL.decode(): layout.secret}

    # Peers
    def refresh(self, state: AppState) -> None:
        return

    def changed(self, state: AppState | None = None) -> None:
        self.layout.shared.write(board_doc(state or self.state, self.extra))

    def publish(self, **extra: Any) -> None:
        """Put something the API processes need before the control process's state exists on the board (the engine
        coordinator's address, a failed start, the order to stop)."""
        self.extra.update(extra)
        self.changed()

    async def settle(self) -> None:
        await asyncio.gather(*(self._call(i, "refresh") for i in range(len(self.clients))))

    async def abort(self, ids: list[str] | None) -> int:
        calls = (self._call(i, "abort", {"request_ids": ids}) for i in range(len(self.clients)))
        answers = await asyncio.gather(*calls)
        return sum(int((a or {}).get("aborted", 0)) for a in answers)

    async def _call(self, index: int, what: str, payload: Any = None) -> Any:
        try:
            status, body = await self.clients[index].call("POST", INTERNAL_PREFIX + what, payload, self._internal)
        except (Unreachable, ConnectionError, TimeoutError) as e:
            if not self.stopping:
                log.warning("API process %d did not answer %s: %s", index, what, e)
            return None
        if status != 200:
            log.warning("API process %d answered %s with %d: %s", index, what, status, body)
            return None
        return body

    # the processes
    def fork(self, settings: Settings, sock: socket.socket, run: Callable[[Settings, ApiPeers, socket.socket], int]
             ) -> None:
        """Start the API processes (forked: see the module docstring), each serving ``sock`` with ``run``."""
        import threading

        others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        if others:  # a fork copies no thread: what they held stays held in the children
            log.warning("forking the API processes with other threads alive: %s", ", ".join(others))
        ctx = multiprocessing.get_context("fork")
        for i in range(self.layout.processes):
            peers = ApiPeers(self.layout, self.plan, i)
            proc = ctx.Process(target=_api_main, args=(settings, peers, sock, run), name=f"ApiServer_{i}",
                               daemon=False)
            proc.start()
            self.processes.append(proc)
        log.info("%d API processes started (pids %s), sharing %s:%d", len(self.processes),
                 ", ".join(str(p.pid) for p in self.processes), settings.host, settings.port)

    def start(self, state: AppState, on_death: Callable[[str], None]) -> None:
        """Once the control process's state exists: publish it, and from now on keep it published and watch the API
        processes."""
        self.state = state
        self.slots.set(self.slot, UP, 1)
        self.changed(state)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._sweep()))
        self._tasks.append(loop.create_task(self._watch(on_death)))

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self.changed()

    async def _watch(self, on_death: Callable[[str], None]) -> None:
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[BaseProcess] = loop.create_future()

        def exited(p: BaseProcess) -> None:
            if not gone.done():
                gone.set_result(p)

        for p in self.processes:  # a process's sentinel becomes readable when it exits
            loop.add_reader(p.sentinel, exited, p)
        try:
            first = await gone
        finally:
            for p in self.processes:
                loop.remove_reader(p.sentinel)
        if self.stopping:
            return
        await asyncio.sleep(0.05)  # the exit codes are there once the sentinel fires
        dead = [p for p in self.processes if p is first or p.exitcode is not None]
        on_death("; ".join(f"API process {p.name} (pid {p.pid}) {_how(p.exitcode)}" for p in dead))

    def info(self) -> list[dict[str, Any]]:
        rows = []
        shared = self.layout.shared
        for i, p in enumerate(self.processes):
            rows.append({"index": i, "role": "api", "pid": p.pid, "alive": p.is_alive(), "socket":
                         self.layout.api_socket(i), **{k: v for k, v in shared.row(i).items() if k != "pid"}})
        rows.append({"index": self.slot, "role": "control", "pid": os.getpid(), "alive": True, "socket":
                     self.layout.control_socket, **{k: v for k, v in shared.row(self.slot).items() if k != "pid"}})
        return rows

    async def stop(self) -> None:
        """Stop the API processes (after the drain: they hold nothing): the board says so, each closes its listener
        and exits; killed after ``STOP_GRACE_S``."""
        self.stopping = True
        for t in self._tasks:
            t.cancel()
        self.publish(stop=True)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.processes:
            await asyncio.to_thread(p.join, max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                log.warning("API process %s (pid %s) did not stop within %gs: killed", p.name, p.pid, STOP_GRACE_S)
                p.kill()
                await asyncio.to_thread(p.join, 5.0)
        for c in self.clients:
            c.close()
        self.layout.cleanup()

    def kill(self) -> None:
        """Last resort (the control process exits without its shutdown): no API process outlives it."""
        for p in self.processes:
            if p.exitcode is None:
                p.kill()
        self.layout.cleanup()

    # HTTP
    async def route(self, scope: Scope, receive: Receive, send: Send, app: Any) -> None:
        """Every request of the control process: a forwarded one is logged with its client's address; the board is
        published before any answer starts, so that what the answer says is what every process serves from then."""
        tag = _header(scope, FORWARDED)
        if tag is not None:
            secret, _, rest = tag.decode("latin-1").partition(" ")
            if secrets.compare_digest(secret, self.layout.secret):
                _, _, client = rest.partition(" ")  # "<api process index> <client host> <client port>"
                host, _, port = client.rpartition(" ")
                scope = dict(scope)
                scope["client"] = (host, int(port)) if port.isdigit() else None  # the request log's, as sent
                scope["headers"] = [(k, v) for k, v in scope["headers"] if k != FORWARDED]

        async def published(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.changed()
            await send(message)

        await app(scope, receive, published)


def _how(code: int | None) -> str:
    if code is None:
        return "is gone"
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


# ------------------------------------------------------------------------------------------------ API process side


class ApiPeers:
    """An API process's side: mirrors the board, forwards server-wide calls, answers the control process's internal
    calls (``AppState.peers`` there)."""

    def __init__(self, layout: Layout, plan: EnginePlan, index: int) -> None:
        self.layout = layout
        self.plan = plan
        self.index = index
        self.slots = layout.shared
        self.slot = index
        self.seen = 0  # the board this process's state last applied
        self._doc: tuple[int, dict[str, Any]] = (0, {})
        self.control: UdsClient | None = None  # made in the process that uses it
        self.exit: Callable[[int], None] | None = None

    def refresh(self, state: AppState) -> None:
        if self.layout.shared.seq != self.seen:
            self.seen, doc = self.latest()
            apply_board(state, doc)
            self.layout.shared.set(self.slot, SEEN, self.seen)

    def latest(self) -> tuple[int, dict[str, Any]]:
        """The board as last published (read again only when it moved)."""
        if self.layout.shared.seq != self._doc[0]:
            self._doc = self.layout.shared.read()
        return self._doc

    def changed(self, state: AppState) -> None:
        return

    async def settle(self) -> None:
        return

    async def abort(self, ids: list[str] | None) -> int:
        return 0

    def info(self) -> list[dict[str, Any]]:
        return []

    def board(self) -> dict[str, Any]:
        return self.latest()[1]

    async def launched(self) -> str | None:
        """Wait until the control process has started the engine cores; the coordinator's statistics address."""
        while True:
            doc = self.board()
            if "launched" in doc:
                return doc["launched"]  # type: ignore[no-any-return]
            if doc.get("start_error") or doc.get("stop"):
                raise RuntimeError(doc.get("start_error") or "the server is stopping")
            await asyncio.sleep(WATCH_S)

    async def watch(self, app: Any) -> None:
        """Between requests: apply the board, become ready with the server, stop when told."""
        while True:
            doc = self.board()
            state: AppState | None = getattr(app.state, "starting_state", None)
            if state is not None:
                self.refresh(state)
                if state.ready and app.state.tito is None:
                    app.state.tito = state  # the whole server is up: this process serves from now
                    log.info("API process %d serving", self.index)
            if doc.get("start_error"):
                app.state.start_error = doc["start_error"]
            if doc.get("stop") and self.exit is not None:
                self.exit(0)
                return
            await asyncio.sleep(WATCH_S)

    def unreachable(self) -> ApiError:
        if self.board().get("ready"):
            return ApiError(503, "the server's control process is not answering; retry.", headers={"Retry-After": "5"})
        return ApiError(503, "server is starting", headers={"Retry-After": "5"})

    async def route(self, scope: Scope, receive: Receive, send: Send, app: Any) -> bool:
        """Serve an internal call or forward a server-wide one; False: this process serves the request itself."""
        path = _path(scope)
        if path.startswith(INTERNAL_PREFIX):
            await self._internal(path, scope, receive, send, app)
            return True
        if path in LOCAL_PATHS:
            return False
        if self.control is None:
            self.control = UdsClient(self.layout.control_socket)
        client = scope.get("client") or ("", 0)
        tag = f"{self.layout.secret} {self.index} {client[0]} {client[1]}".encode("latin-1")
        self.layout.shared.add(self.slot, FORWARDED_COUNT)
        await forward(self.control, scope, receive, send, tag, self.unreachable)
        return True

    async def _internal(self, path: str, scope: Scope, receive: Receive, send: Send, app: Any) -> None:
        given = _header(scope, INTERNAL) or b""
        if not secrets.compare_digest(given, self.layout.secret.encode()):
            answer = json_response({"detail": "Not Found"}, 404)
            await answer(scope, receive, send)
            return
        import orjson

        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        state: AppState | None = getattr(app.state, "starting_state", None)
        out: dict[str, Any] = {"index": self.index}
        if state is not None:
            self.refresh(state)
            if path == INTERNAL_PREFIX + "abort":
                ids = (orjson.loads(body) if body else {}).get("request_ids")
                targets = list(state.live) if ids is None else state.resolve_ids(ids)
                if targets and not state.engine.errored:
                    await state.engine.abort(targets)
                out["aborted"] = len(targets)
        out["inflight"] = state.local if state is not None else 0
        await json_response(out)(scope, receive, send)


# ------------------------------------------------------------------------------------------------ the API process


def _die_with_parent(parent: int) -> None:
    """The API process goes when the control process goes, however it goes (Linux; elsewhere the watch of the
    board's stop order is the only way)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it went before the call above
        os._exit(1)


def _api_main(settings: Settings, peers: ApiPeers, sock: socket.socket,
              run: Callable[[Settings, ApiPeers, socket.socket], int]) -> None:
    """An API process, from its fork to its exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the control process handles it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the control process drains and stops the server
    _die_with_parent(peers.layout.owner)
    peers.plan.keep_only(peers.index)
    peers.layout.shared.set(peers.index, UP, 0)
    code = 1
    try:
        code = run(settings, peers, sock)
    except BaseException:  # noqa: BLE001 - logged; the control process ends the server
        log.exception("API process %d failed", peers.index)
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - exiting anyway
                pass
        # Not the interpreter's exit: the atexit handlers inherited from the control process are its own.
        os._exit(code)
