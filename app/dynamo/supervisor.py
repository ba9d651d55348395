"""The child sidecar's supervisor (``tito serve --dynamo-namespace``): the replica is in Dynamo's discovery exactly
while its sidecar runs, so the sidecar's life follows the replica's.

- **Joins only when ready.** The sidecar starts once the server is ready (engine up, the recorded weights restored,
  app/weights/restore.py): a replica that could not restore its weights never joins.
- **Leaves first.** ``withdraw`` (drain, SIGTERM, a dead engine) SIGTERMs the sidecar and waits for it to exit:
  Dynamo 1.6.1's sidecar then withdraws its readiness, removes the worker from discovery, waits its grace period and
  lets the streams it carries finish. Only after that does tito refuse new work, so no request depends on the
  frontend's retry. ``rejoin`` (undrain) starts a new one.
- **Restarts a dead sidecar.** A sidecar that exits on its own is started again after 1, 2, 4 ... 30 s (a run of a
  minute resets the count), at most ``MAX_RESTARTS`` times in a row, then ``failed``; each restart is logged and
  counted in ``/server_info`` (``dynamo``).

Dynamo 1.6.1's sidecar checks tito's gRPC health only at its start; it does not follow tito's readiness after that,
which is why tito moves the sidecar itself.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

from app.core.settings import Settings
from app.dynamo.sidecar import STOP_TIMEOUT_S, admin_base_url, dynamo_available, sidecar_command

log = logging.getLogger("tito.dynamo")

BACKOFF_S, BACKOFF_MAX_S = 1.0, 30.0
MAX_RESTARTS = 10  # in a row, each run shorter than STABLE_S
STABLE_S = 60.0
POLL_S = 0.2


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when tito dies (a SIGKILLed tito must not leave its worker in discovery
    with nothing behind it). Linux's PR_SET_PDEATHSIG; elsewhere nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


class SidecarSupervisor:
    """One per server with ``--dynamo-namespace`` (``app.state.sidecar``, ``AppState.sidecar``)."""

    def __init__(self, settings: Settings) -> None:
        if not dynamo_available():
            raise SystemExit("tito: --dynamo-namespace needs Dynamo's sidecar: pip install 'tito[dynamo]' and "
                             "pip install --no-deps ai-dynamo==1.6.1")
        self.settings = settings
        self.cmd, self.env = sidecar_command(settings)  # a bad combination stops the server before it starts
        self.proc: subprocess.Popen[bytes] | None = None
        self.wanted = True  # in the fleet unless withdrawn
        # waiting (for the server to be ready) | running | restarting | stopping | stopped | failed
        self.status = "waiting"
        self.restarts = 0  # restarts after the sidecar died on its own
        self.failures_in_row = 0
        self.started_at: float | None = None
        self.next_start: float = 0.0
        self.last_exit: dict[str, Any] | None = None
        self.withdrawn_at: float | None = None
        self.reason: str | None = None  # why it is stopped (drain, shutdown, engine dead)
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------ life

    def start(self, ready: Callable[[], bool]) -> None:
        """Supervise from now on; the sidecar starts once ``ready()`` is true."""
        self._task = asyncio.ensure_future(self._watch(ready))

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(self.cmd, env=self.env, preexec_fn=_die_with_parent)  # noqa: PLW1509
        self.started_at = time.monotonic()
        self.status = "running"
        log.info("dynamo: sidecar pid %d for gRPC port %s in namespace %r, admin_base_url %s%s", self.proc.pid,
                 self.settings.grpc_port, self.settings.dynamo_namespace, admin_base_url(self.settings),
                 "" if "--enable-rl" in self.cmd else " (no system port: no RL discovery)")

    async def _watch(self, ready: Callable[[], bool]) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            async with self._lock:
                proc = self.proc
                if proc is not None and proc.poll() is not None:
                    self._died(proc)
                if self.proc is None and self.wanted and self.status != "failed" and \
                        time.monotonic() >= self.next_start and ready():
                    self._spawn()

    def _died(self, proc: subprocess.Popen[bytes]) -> None:
        """The sidecar exited without being asked to: schedule a restart (or give up)."""
        ran = time.monotonic() - (self.started_at or time.monotonic())
        self.proc = None
        self.last_exit = {"code": proc.returncode, "at": time.time(), "ran_s": round(ran, 1)}
        self.failures_in_row = 1 if ran >= STABLE_S else self.failures_in_row + 1
        if self.failures_in_row > MAX_RESTARTS:
            self.status = "failed"
            log.error("dynamo: sidecar pid %d exited with %s after %.1fs; %d restarts in a row failed, giving up: "
                      "this replica is out of the fleet (POST /drain then /undrain to try again)", proc.pid,
                      proc.returncode, ran, MAX_RESTARTS)
            return
        delay = min(BACKOFF_S * 2 ** (self.failures_in_row - 1), BACKOFF_MAX_S)
        self.restarts += 1
        self.status = "restarting"
        self.next_start = time.monotonic() + delay
        log.warning("dynamo: sidecar pid %d exited with %s after %.1fs; restarting it in %.0fs (restart %d)",
                    proc.pid, proc.returncode, ran, delay, self.restarts)

    async def withdraw(self, reason: str, timeout: float = STOP_TIMEOUT_S) -> float:
        """Leave the fleet: stop the sidecar gracefully (it leaves discovery, lets its streams finish) and wait for it;
        returns the seconds it took. No restart until ``rejoin``."""
        t0 = time.monotonic()
        async with self._lock:
            self.wanted = False
            self.reason = reason
            proc, self.proc = self.proc, None
            if proc is None or proc.poll() is not None:
                self.status = "stopped"
                return 0.0
            self.status = "stopping"
            self.withdrawn_at = time.time()
            log.info("dynamo: leaving the fleet (%s): stopping sidecar pid %d", reason, proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout)
            except TimeoutError:
                log.warning("dynamo: sidecar pid %d did not stop within %gs; killing it", proc.pid, timeout)
                proc.kill()
                await asyncio.to_thread(proc.wait, 5)
            self.status = "stopped"
        dt = time.monotonic() - t0
        log.info("dynamo: out of the fleet (%s) after %.1fs: sidecar exited with %s", reason, dt, proc.returncode)
        return dt

    def rejoin(self) -> None:
        """Back into the fleet (undrain): a new sidecar as soon as the server is ready."""
        if not self.wanted or self.status == "failed":
            log.info("dynamo: rejoining the fleet: starting a sidecar")
        self.wanted = True
        self.reason = None
        self.failures_in_row = 0
        self.next_start = 0.0
        if self.status in ("stopped", "failed"):
            self.status = "waiting"

    def stop_now(self) -> None:
        """At exit, whatever happened before: no sidecar outlives the server."""
        if self._task is not None:
            self._task.cancel()
        proc, self.proc = self.proc, None
        self.wanted = False
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.status = "stopped"

    # ------------------------------------------------------------------ reporting

    def info(self) -> dict[str, Any]:
        proc = self.proc
        return {"sidecar": self.status, "pid": proc.pid if proc is not None else None, "restarts": self.restarts,
                "last_exit": self.last_exit, "reason": self.reason, "namespace": self.settings.dynamo_namespace,
                "component": self.settings.dynamo_component, "admin_base_url": admin_base_url(self.settings),
                "system_port": self.env.get("DYN_SYSTEM_PORT")}
