"""The control plane's one rule: pause, resume and weight updates are transitions, run one at a time, in order.

Each transition holds ``ControlPlane.lock`` (an ``asyncio.Lock``: FIFO) from the moment it touches the engine until
it has finished, and runs as its own task, so a client that disconnects or times out never leaves it half done.
Defined outcomes of concurrent calls:

- Calls queue in arrival order; each sees the engine as the previous one left it. A weight update holds its place in
  the queue like any other transition: a ``/pause`` sent during an update is applied after the update (the update's
  own resume cannot undo it), a ``/resume`` sent during an update resumes after it.
- ``/pause?mode=wait`` that does not drain within its timeout is *cancelled*: tito resumes the engine (if this call
  paused it) before answering 504, so no pause lands later. A ``/resume`` that arrives while a ``mode=wait`` pause is
  still draining supersedes it: the pause is cancelled the same way and answers 409, then the resume runs. The last
  call wins.
- A call that cannot get its turn within its own timeout changes nothing and answers 409.
- A pause may carry a lease (``/pause?lease=S``, default ``--pause-lease``, 0: none): when ``S`` seconds pass with no
  control call (each one renews it), tito resumes by itself, as a transition in the queue like any other (never in
  the middle of an update), logs a warning and counts it in ``tito_pause_lease_expired_total``. Off by default: the
  trainers resume themselves (see docs/guides/weight-updates.md, "A pause nobody ends").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from app.core import metrics
from app.core.protocol import ApiError

if TYPE_CHECKING:
    from app.engine.adapter import Engine
    from app.weights.updates import WeightManager

log = logging.getLogger("tito.control")
T = TypeVar("T")
# Bound on a plain engine call (resume, is_paused): they answer in milliseconds unless the engine is stuck.
ENGINE_CALL_TIMEOUT_S = 60.0


class ControlPlane:
    """One per server (``AppState.control``)."""

    def __init__(self, engine: Engine, weights: WeightManager, *, inflight: Callable[[], int]) -> None:
        """``weights``: the update in progress and the weights' consistency; ``inflight()`` counts the requests in
        flight."""
        self.engine = engine
        self.weights = weights
        self._inflight = inflight
        self.lock = asyncio.Lock()
        self.holder: str | None = None  # what holds the lock now, for error messages and /server_info
        self.queued = 0
        self.updates = 0  # weight updates queued or running under the lock (guard)
        # Set by a /resume that arrives while a mode=wait pause is draining: that pause gives way.
        self._supersede: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.paused_mode: str | None = None  # the mode of the pause this plane applied last (None: resumed)
        # The last transitions in the order they ran: (name, outcome), for /server_info and for tests.
        self.history: deque[tuple[str, str]] = deque(maxlen=32)
        # The pause lease: seconds the current pause holds without a control call (0: until /resume).
        self.lease = 0.0
        self._lease_deadline = 0.0
        self._lease_task: asyncio.Task[None] | None = None

    async def run(self, name: str, fn: Callable[[], Awaitable[T]], wait: float | None, *, shield: bool = True) -> T:
        """Run ``fn`` as the next transition; ``wait`` bounds the time spent queued (409 then). ``shield``: in a task
        of its own, so a caller that is cancelled (a gRPC client that leaves) never leaves it half done. A caller that
        is never cancelled (an HTTP handler: uvicorn lets it finish when its client leaves) runs it in place instead:
        under load every task hand-over waits a turn of the busy loop, and a shielded transition costs three."""
        if not shield:
            return await self._locked(name, fn, wait)
        task = asyncio.ensure_future(self._locked(name, fn, wait))
        self._tasks.add(task)  # a reference until done: the task outlives a cancelled caller
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    def guard(self, name: str, fn: Callable[[], Awaitable[T]]) -> Callable[[], Awaitable[T]]:
        """``fn`` wrapped to run under the lock, for callers that already run in a task of their own (an update)."""

        async def guarded() -> T:
            self.updates += 1
            try:
                return await self._locked(name, fn, None)
            finally:
                self.updates -= 1

        return guarded

    async def _locked(self, name: str, fn: Callable[[], Awaitable[T]], wait: float | None) -> T:
        label = _label(name)
        t0 = time.perf_counter()
        self.queued += 1
        try:
            if wait is None:
                await self.lock.acquire()
            else:
                try:
                    await asyncio.wait_for(self.lock.acquire(), wait)
                except TimeoutError:
                    raise ApiError(409, f"{name}: {self.holder or 'another control call'} was still running after "
                                        f"{wait:g}s; nothing was changed, retry later.") from None
        finally:
            self.queued -= 1
        t1 = time.perf_counter()
        metrics.CONTROL_SECONDS.labels(label, "queued").observe(t1 - t0)
        self.holder = name
        outcome = "error"
        try:
            out = await fn()
            outcome = "ok"
            return out
        except ApiError as e:
            outcome = str(e.status)
            raise
        finally:
            metrics.CONTROL_SECONDS.labels(label, "run").observe(time.perf_counter() - t1)
            if self.lease:
                self._lease_deadline = time.monotonic() + self.lease  # a live trainer renews the lease
            self.history.append((name, outcome))
            self.holder = None
            self.lock.release()

    def info(self) -> dict[str, Any]:
        left = max(0.0, self._lease_deadline - time.monotonic()) if self.lease else None
        return {"running": self.holder, "queued": self.queued, "paused_mode": self.paused_mode,
                "pause_lease_s": self.lease or None, "pause_lease_left_s": left,
                "recent": [{"call": n, "outcome": o} for n, o in self.history]}

    # ------------------------------------------------------------------ transitions

    async def after_update(self, wait: float) -> None:
        """Wait (up to ``wait`` s, else 409) for a weight update that runs outside this queue (a retry joining it)."""
        mgr = self.weights
        if mgr.busy and not self.updates:
            # Also a native update (/start_weight_update .. /finish_weight_update), which holds no task of its own.
            log.info("control call waits for the running weight update")
            if not await mgr.wait_idle(wait):
                raise ApiError(409, f"a weight update is still running after {wait:g}s; retry later.")

    async def pause(self, mode: str, clear_cache: bool, timeout: float, *, lease: float = 0.0,
                    shield: bool = True) -> None:
        async def do() -> None:
            await self._pause(mode, clear_cache, timeout)
            self._arm_lease(lease)

        await self.after_update(timeout)
        await self.run(f"pause (mode={mode})", do, timeout, shield=shield)

    async def _pause(self, mode: str, clear_cache: bool, timeout: float) -> None:
        eng = self.engine
        was_paused = await eng.is_paused()  # tito's record: no round trip behind the step in progress
        if mode != "wait":
            # abort and keep return as soon as the engine has frozen or aborted its requests. Awaited here, not in a
            # task of its own: under load each task hand-over waits a turn of the busy loop.
            await eng.pause(mode=mode, clear_cache=clear_cache)
            self._paused(mode)
            return
        task = asyncio.ensure_future(eng.pause(mode=mode, clear_cache=clear_cache))
        supersede = self._supersede = asyncio.Event()
        given_way = asyncio.ensure_future(supersede.wait())
        # ``timeout`` bounds the wait for in-flight requests; with none there is nothing to drain, and the engine's
        # own round trip gets the usual engine-call bound (a timeout of 1e-300 must not turn an idle pause into 504).
        limit = timeout if self._inflight() else max(timeout, ENGINE_CALL_TIMEOUT_S)
        try:
            done, _ = await asyncio.wait({task, given_way}, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        finally:
            given_way.cancel()
            self._supersede = None
        if task in done:
            task.result()  # raises the engine's error, if any
            self._paused(mode)
            return
        # Not drained in time, or a /resume came: cancel this pause. vLLM stops admitting at once and completes the
        # pause when the last request ends; resuming now (unless the engine was paused before this call) means
        # nothing of this call lands later. The pending engine future then only clears caches.
        task.add_done_callback(_quiet)
        if not was_paused:
            await eng.resume()
            self._paused(None)
        elif self.paused_mode == "keep":
            await eng.pause(mode="keep", clear_cache=False)  # mode=wait had let the frozen requests step again
        if supersede.is_set():
            log.info("pause (mode=wait) superseded by a later /resume before it drained; cancelled")
            raise ApiError(409, "pause (mode=wait) was superseded by a later /resume before the engine drained; "
                                "the pause was cancelled.")
        log.warning("pause (mode=wait) did not drain within %gs; cancelled, generation continues", timeout)
        raise ApiError(504, f"pause (mode=wait) did not drain within {timeout:g}s; the pause was cancelled and "
                            "generation continues.")

    async def resume(self, wait: float, *, shield: bool = True) -> None:
        if self._supersede is not None:
            self._supersede.set()  # the last call wins: a draining mode=wait pause gives way to this resume

        await self.after_update(wait)
        await self.run("resume", self._resume, wait, shield=shield)

    async def _resume(self) -> None:
        bad = self.weights.inconsistent
        if bad is not None:
            # Never resume onto a mix of weight versions; the update that repairs them resumes if it paused.
            raise ApiError(409, f"{bad.message()} before resuming; /resume is refused until then.")
        try:
            await asyncio.wait_for(self.engine.resume(), ENGINE_CALL_TIMEOUT_S)
        except TimeoutError:
            raise ApiError(504, f"resume did not finish within {ENGINE_CALL_TIMEOUT_S:g}s.") from None
        self._paused(None)

    def _arm_lease(self, lease: float) -> None:
        """Start (or replace, or with 0 end) the lease of the pause just applied."""
        self.end_lease()
        self.lease = lease
        self._lease_deadline = time.monotonic() + lease
        if lease:
            self._lease_task = asyncio.ensure_future(self._watch_lease())

    def end_lease(self) -> None:
        """No lease from now on (a resume, a pause without one, the server's shutdown)."""
        self.lease = 0.0
        if self._lease_task is not None:
            # Safe at any point: the expiry's own transition runs shielded and checks the lease at its turn.
            self._lease_task.cancel()
            self._lease_task = None

    async def _watch_lease(self) -> None:
        while self.lease:
            left = self._lease_deadline - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)
                continue
            if self.lock.locked():
                async with self.lock:  # a transition is running: it renews the lease as it ends; look again then
                    pass
                continue
            if self.weights.busy and not self.updates:
                # An update outside the queue (vLLM's native start .. finish) is never cut either, as for /resume.
                await self.weights.wait_idle(ENGINE_CALL_TIMEOUT_S)
                continue
            # In the queue like any other call, never in the middle of one; at its turn it checks again, since a
            # call that slipped in first renewed the lease.
            await self.run("resume (pause lease expired)", self._expire_lease, None)

    async def _expire_lease(self) -> None:
        if not self.lease or time.monotonic() < self._lease_deadline:
            return
        lease = self.lease
        try:
            await self._resume()
        except ApiError as e:
            self.lease = 0.0  # the watch ends: the pause stays until a /resume succeeds
            metrics.PAUSE_LEASE_EXPIRED.labels("refused").inc()
            log.error("pause lease of %gs expired with no control call since, but resuming was refused: %s",
                      lease, e.message)
            return
        metrics.PAUSE_LEASE_EXPIRED.labels("resumed").inc()
        log.warning("pause lease of %gs expired with no control call since (did the trainer die before its "
                    "/resume?); generation resumed", lease)

    async def reset_prefix_cache(self, reset_running_requests: bool, reset_external: bool, wait: float, *,
                                 shield: bool = True) -> bool:
        """vLLM's ``/reset_prefix_cache`` as a transition: after a running weight update (which resets the cache
        itself) and earlier control calls, never between an update's load and its own reset."""
        async def do() -> bool:
            try:
                return await asyncio.wait_for(self.engine.reset_prefix_cache(reset_running_requests,
                                                                             reset_external),
                                              ENGINE_CALL_TIMEOUT_S)
            except TimeoutError:
                raise ApiError(504, f"reset_prefix_cache did not finish within {ENGINE_CALL_TIMEOUT_S:g}s.") from None

        await self.after_update(wait)
        return await self.run("reset_prefix_cache", do, wait, shield=shield)

    def _paused(self, mode: str | None) -> None:
        self.paused_mode = mode
        if mode is None:
            self.end_lease()
        metrics.PAUSED.set(0 if mode is None else 1)


def _label(name: str) -> str:
    """The metric label of a transition: its kind, not its version (commit names carry one)."""
    if name.startswith("pause (mode="):
        return "pause_" + name.removeprefix("pause (mode=").rstrip(")")
    if name.startswith(("weight update", "commit ")):
        return "weight_update"
    return name


def _quiet(fut: asyncio.Future[Any]) -> None:
    """Retrieve a cancelled pause's late outcome so asyncio does not log it as never retrieved."""
    if not fut.cancelled():
        fut.exception()
