"""Process lifecycle: the HTTP server, SIGTERM drain, fast shutdown on a second signal, exit when the engine dies.

The HTTP server is granian's (Rust HTTP/1.1, embedded in tito's own asyncio loop): for a streamed answer it costs
about a quarter less CPU per event than uvicorn on the server and a third less on the client (`scripts/bench.py`;
on 2 cores that CPU is the engine's). The lifecycle around it is tito's own: a replica that is leaving keeps
answering — ``/ready`` 503 and new generate requests 503 with ``Retry-After`` — while its in-flight requests finish,
then aborts what is left, stops the server (the lifespan shuts the engine down) and exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

    from app.state import AppState

log = logging.getLogger("tito.lifecycle")

# After a drain (or abort) the connections are idle or closing; the server only needs a moment to close them.
CLOSE_GRACE_S = 5.0
# How long aborted requests get to write their final (partial) answer before the server stops.
ABORT_GRACE_S = 5.0
# The lifespan's shutdown (services, then the engine: vLLM's own shutdown takes seconds) after the server stopped.
STOP_TIMEOUT_S = 60.0
# Longer than any client's idle keep-alive: a server closing an idle connection just as the client reuses it is how
# vLLM's own server "drops" requests (ServerDisconnectedError). granian counts the idle time as header-read time.
KEEP_ALIVE_S = 120
# Connections waiting to be accepted, and requests the server runs at once (granian's default is 128 of each:
# fewer than one trainer's rollouts).
BACKLOG = 4096
MAX_CONCURRENT_REQUESTS = 65536
# The process exit code when the server stopped before it was told to (the port could not be bound, ...).
SERVER_FAILED = 3


class Lifecycle:
    """Runs the HTTP server until it is told to stop; returns the exit code.

    - SIGTERM: drain for up to ``--shutdown-timeout`` seconds (the listener stays open: new work gets 503), abort
      what is left, then stop; the lifespan shuts the engine down; exit code 0.
    - SIGINT, or a second signal during the drain: the same without the wait (abort in-flight work now).
    - ``request_exit(code)`` (``app.state.request_exit``): stop with that exit code (the engine died or could not
      start).
    """

    def __init__(self, app: FastAPI, server: Any) -> None:
        self.app = app
        self.server = server
        self.exit_code = 0
        self._signals: list[int] = []
        self._immediate = asyncio.Event()
        self._stop = asyncio.Event()
        self._drain: asyncio.Task[None] | None = None
        app.state.request_exit = self.request_exit

    def request_exit(self, code: int) -> None:
        if not self._stop.is_set():
            self.exit_code = code
        self._stop.set()

    def on_signal(self, sig: int) -> None:
        self._signals.append(sig)
        state: AppState | None = getattr(self.app.state, "tito", None)
        if state is None:
            self._stop.set()  # still starting (or already stopped): nothing to drain
            return
        if sig != signal.SIGTERM or len(self._signals) > 1:
            self._immediate.set()
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_stop(state))

    async def _drain_then_stop(self, state: AppState) -> None:
        try:
            await drain_for_shutdown(state, state.settings.shutdown_timeout, self._immediate)
        except Exception:  # noqa: BLE001 - whatever happens, the server must still stop
            log.exception("shutdown drain failed")
        self._stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)
        serving = asyncio.ensure_future(self.server.serve())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({serving, stop}, return_when=asyncio.FIRST_COMPLETED)
            if serving.done():
                # The server ended by itself: it could not bind its port, or its lifespan failed.
                exc = serving.exception()
                if exc is not None:
                    log.error("the HTTP server failed: %s: %s", type(exc).__name__, exc)
                return self.exit_code or SERVER_FAILED
            self.server.stop()
            try:
                # Closing the connections, then the lifespan's shutdown (the engine).
                await asyncio.wait_for(asyncio.shield(serving), CLOSE_GRACE_S + STOP_TIMEOUT_S)
            except TimeoutError:
                log.error("the server did not stop within %.0fs; exiting anyway", CLOSE_GRACE_S + STOP_TIMEOUT_S)
                serving.cancel()
            except Exception as e:  # noqa: BLE001 - stopping anyway
                log.error("stopping the HTTP server failed: %s", e)
            return self.exit_code
        finally:
            stop.cancel()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)


async def drain_for_shutdown(state: AppState, timeout: float, immediate: asyncio.Event) -> None:
    """Refuse new work, wait for in-flight requests (up to ``timeout`` s, or until ``immediate`` is set), then
    abort the rest and give them a moment to answer with their partial tokens."""
    t0 = time.monotonic()
    state.begin_shutdown()
    n0 = state.inflight
    if n0 and not immediate.is_set():
        log.info("shutting down: draining %d in-flight request(s) for up to %.0fs (signal again to abort them now)",
                 n0, timeout)
        idle = asyncio.ensure_future(state.wait_idle(timeout))
        now = asyncio.ensure_future(immediate.wait())
        try:
            await asyncio.wait({idle, now}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            now.cancel()
    finished, left = state.finished_since_drain, state.inflight
    if left:
        await state.abort()
        log.warning("shutting down: aborting %d request(s) still in flight after %.1fs", left, time.monotonic() - t0)
        await state.wait_idle(ABORT_GRACE_S)
    log.info("shutting down: %d request(s) finished during the drain, %d aborted (%.1fs)", finished, left,
             time.monotonic() - t0)


def http_server(app: FastAPI, host: str, port: int) -> Any:
    """granian's HTTP/1.1 server for ``app``, embedded in the running loop (its Rust side does the socket I/O)."""
    from granian.constants import HTTPModes, Interfaces
    from granian.http import HTTP1Settings
    from granian.log import LogLevels
    from granian.server.embed import Server

    quiet = {"handlers": [], "propagate": True}  # through tito's own log handler and format
    return Server(app, address=host, port=port, interface=Interfaces.ASGI, http=HTTPModes.http1, websockets=False,
                  backlog=BACKLOG, backpressure=MAX_CONCURRENT_REQUESTS,
                  http1_settings=HTTP1Settings(header_read_timeout=KEEP_ALIVE_S * 1000),
                  # Its one warning at every start is "Embedded server is experimental!"; errors still show.
                  log_level=LogLevels.error,
                  log_dictconfig={"loggers": {"_granian": quiet, "granian.access": quiet}})


def serve(app: FastAPI, host: str, port: int) -> int:
    """Serve ``app`` until it is told to stop; returns the process exit code."""
    import uvloop

    async def main() -> int:
        return await Lifecycle(app, http_server(app, host, port)).run()

    return uvloop.run(main())
