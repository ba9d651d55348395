"""Process lifecycle: SIGTERM drain, fast shutdown on a second signal, and exit when the engine dies.

uvicorn's own SIGTERM handling closes the listening socket at once and waits for open connections; a replica that is
leaving should instead keep answering — ``/ready`` 503 and new generate requests 503 with ``Retry-After`` — while
its in-flight requests finish, then abort what is left, shut the engine down and exit 0. ``TitoServer`` does that.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
import ssl
import sys
import threading
import time
import traceback
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

import uvicorn

if TYPE_CHECKING:
    from fastapi import FastAPI

    from app.core.settings import Settings
    from app.server.state import AppState

log = logging.getLogger("tito.lifecycle")

# After a drain (or abort) the connections are idle or closing; uvicorn only needs a moment to close them.
CLOSE_GRACE_S = 5.0
# How long the atexit handlers get at the end of `tito serve` (exit_now).
EXIT_HANDLERS_S = 10.0
# How long aborted requests get to write their final (partial) answer before the server stops.
ABORT_GRACE_S = 5.0


class TitoServer(uvicorn.Server):
    """uvicorn's server with tito's shutdown.

    - SIGTERM: drain for up to ``--shutdown-timeout`` seconds (the listener stays open: new work gets 503), abort
      what is left, then stop; the lifespan shuts the engine down; exit code 0.
    - SIGINT, or a second signal during the drain: the same without the wait (abort in-flight work now).
    - ``request_exit(code)``: stop with that exit code (used when the engine dies).
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app = app
        self.exit_code = 0
        self._signals: list[int] = []
        self._immediate = asyncio.Event()
        self._shutdown_task: asyncio.Task[None] | None = None
        app.state.request_exit = self.request_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: only record; ``on_tick`` (every 0.1 s on the loop) acts on it. Unlike uvicorn's handler
        # this does not re-raise the signal after shutdown, so a clean drain exits 0.
        self._signals.append(sig)
        self.app.state.stop_signalled = True  # the engine watcher reads it (tito/main.py: a group signal)
        if getattr(self.app.state, "tito", None) is None:
            # Still starting (or already stopped): nothing to drain.
            self.should_exit = True

    def request_exit(self, code: int) -> None:
        self.exit_code = code
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._signals and not self.should_exit:
            state: AppState | None = getattr(self.app.state, "tito", None)
            if state is None:
                self.should_exit = True
            else:
                immediate = self._signals[0] != signal.SIGTERM or len(self._signals) > 1
                if immediate and not self._immediate.is_set():
                    self._immediate.set()
                if self._shutdown_task is None:
                    self._shutdown_task = asyncio.ensure_future(self._drain_then_exit(state))
        return await super().on_tick(counter)

    async def _drain_then_exit(self, state: AppState) -> None:
        try:
            await leave_fleet(state, self._immediate)
            await drain_for_shutdown(state, state.settings.shutdown_timeout, self._immediate)
        except Exception:  # noqa: BLE001 - whatever happens, the server must still stop
            log.exception("shutdown drain failed")
        self.should_exit = True


async def leave_fleet(state: AppState, immediate: asyncio.Event) -> None:
    """SIGTERM with a child sidecar: out of discovery first, while still admitting what the frontend sends until it
    has noticed (no dead worker in discovery while the engine goes down). A second signal stops waiting."""
    if state.sidecar is None:
        return
    leave = asyncio.ensure_future(state.leave_fleet("shutdown"))
    now = asyncio.ensure_future(immediate.wait())
    try:
        await asyncio.wait({leave, now}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        now.cancel()


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


def exit_now(code: int) -> NoReturn:
    """End ``tito serve`` after its clean shutdown without Python's interpreter teardown. The atexit handlers run and
    the logs are flushed, as on a normal exit; what is skipped is the module teardown, after which Triton's nanobind
    bindings (imported by torch._dynamo, unused on a CPU) print ~30 lines of "nanobind: leaked ... instances/types/
    functions": Triton objects still referenced when the interpreter finalizes, not a leak of this process. The handlers
    get ``EXIT_HANDLERS_S``: one that blocks (a join on a child that never ends) does not keep the process alive."""
    done = threading.Event()

    def handlers() -> None:
        try:
            atexit._run_exitfuncs()
        finally:
            done.set()

    runner = threading.Thread(target=handlers, name="tito-exit-handlers", daemon=True)
    runner.start()
    if not done.wait(EXIT_HANDLERS_S):
        frame = sys._current_frames().get(runner.ident or -1)
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
        log.warning("exit handlers still running after %.0fs: exiting without waiting for them; the one running:\n%s",
                    EXIT_HANDLERS_S, where.rstrip())
    log.info("exiting with code %d", code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class _SkipPaths(logging.Filter):
    """vLLM's --disable-access-log-for-endpoints: no access-log line for these paths (uvicorn's record args are
    client, method, path, HTTP version, status)."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__()
        self.paths = tuple(p.strip() for p in paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) > 2 and str(args[2]).split("?", 1)[0] in self.paths)


def serve(app: FastAPI, settings: Settings) -> int:
    """Run the app until it is told to stop; returns the process exit code. vLLM's HTTP-server arguments (TLS, root
    path, h11 limits, uvicorn's log level and access log) apply as on ``vllm serve``."""
    v = settings.vllm_args
    endpoints = [p for p in (v.get("disable_access_log_for_endpoints") or "").split(",") if p]
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level=v.get("uvicorn_log_level", "warning"),
        # Off unless asked for (vLLM's server logs every request): a line per request costs the API process CPU.
        access_log="uvicorn_log_level" in v and not v.get("disable_uvicorn_access_log"),
        # Longer than any client's idle keep-alive: a server closing an idle connection just as the client reuses
        # it is how vLLM's own server "drops" requests (ServerDisconnectedError).
        timeout_keep_alive=120,
        # The drain happened before uvicorn's own shutdown starts; this only bounds closing the connections.
        timeout_graceful_shutdown=int(CLOSE_GRACE_S),
        ssl_keyfile=v.get("ssl_keyfile"),
        ssl_certfile=v.get("ssl_certfile"),
        ssl_ca_certs=v.get("ssl_ca_certs"),
        ssl_cert_reqs=v.get("ssl_cert_reqs", ssl.CERT_NONE),
        ssl_ciphers=v.get("ssl_ciphers") or "TLSv1",
        root_path=v.get("root_path") or "",
        h11_max_incomplete_event_size=v.get("h11_max_incomplete_event_size"),
    )
    if endpoints:
        logging.getLogger("uvicorn.access").addFilter(_SkipPaths(endpoints))
    server = TitoServer(config, app)
    server.run()
    if not server.started:
        return 3  # the lifespan failed (engine did not start); uvicorn has logged why
    return server.exit_code
