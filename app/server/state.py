"""AppState: the one object that holds what the server knows, built in the lifespan, reached through dependencies."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request

from app.core.metrics import DRAINING, INFLIGHT
from app.core.multimodal import MediaPolicy
from app.core.protocol import ApiError
from app.core.settings import Settings
from app.engine.adapter import Engine, EngineDead, EngineRejected, ModelFacts
from app.engine.sampling import Limits, min_tokens_refusal
from app.server.control import ControlPlane
from app.weights.areal import ArealSync
from app.weights.lora import LoraEntry, LoraManager
from app.weights.staging import StagingManager
from app.weights.updates import WeightManager

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess


class FleetMembership(Protocol):
    """What the server needs of the child Dynamo sidecar's supervisor (app/dynamo/supervisor.py)."""

    wanted: bool

    async def withdraw(self, reason: str) -> float: ...

    def rejoin(self) -> None: ...

    def info(self) -> dict[str, Any]: ...

GENERATE_PREFIX = "generate-tokens-"
# The prefixes of the ids clients see (the token API's, vLLM's completion and chat ids): a bare client id names all.
CLIENT_PREFIXES = (GENERATE_PREFIX, "cmpl-", "chatcmpl-")
log = logging.getLogger("tito")


class Peers(Protocol):
    """The other processes of this server, with ``--api-server-count`` N > 1 (app/server/api_processes.py); None when
    this process is the whole server. The control process's peers are the N API processes; an API process's, the
    control process (through the shared board) and the other API processes (through its slots)."""

    slots: Any  # the shared per-process counters (app/server/board.py), written at every enter and leave
    slot: int  # this process's row

    def refresh(self, state: AppState) -> None:
        """An API process: apply the server-wide state published since it last looked (a no-op otherwise)."""

    def changed(self, state: AppState) -> None:
        """The control process: publish the server-wide state if it changed (a no-op otherwise)."""

    async def settle(self) -> None:
        """The control process: return once every API process has applied the state just published."""

    async def abort(self, ids: list[str] | None) -> int:
        """The control process: abort the API processes' requests named by ``ids`` (all: None); how many."""

    def info(self) -> list[dict[str, Any]]:
        """The control process: each process (API processes, then itself) with its counts."""


@dataclass
class AppState:
    """What a server process knows. With one API process (the default) all of it lives here; with N > 1, each API
    process has its own and the control process holds the server-wide part, which the API processes mirror from the
    board it publishes (``app/server/api_processes.py``; ``SERVER_WIDE`` below lists it, ``PER_PROCESS`` the rest).
    Routes read both parts the same way."""

    settings: Settings
    engine: Engine  # this process's client of the engine cores
    # --- server-wide (the control process's; mirrored by API processes)
    started_at: float = field(default_factory=time.time)
    # Admission: draining/shutting-down refuse new generate requests; in-flight is counted for drain.
    draining: bool = False
    shutting_down: bool = False
    ready: bool = False
    # {"time": epoch seconds, "cause": str} once the engine is found dead.
    engine_failure: dict[str, Any] | None = None
    drain_started_at: float | None = None
    # The child Dynamo sidecar's supervisor (``--dynamo-namespace``; app/dynamo/supervisor.py), and whether the replica
    # is leaving the fleet right now (the sidecar stopping, before tito refuses work).
    sidecar: FleetMembership | None = None
    leaving: bool = False
    # --- per process
    # An API process of several (``--api-server-count``): its routes that change the server go to the control process.
    api_process: bool = False
    peers: Peers | None = None
    local: int = 0  # requests in flight in this process (``inflight``: on the whole server)
    finished: int = 0  # requests this process finished, ever
    _drain_mark: int = 0  # requests the server had finished when the drain began
    # The engine's child processes (EngineCore per DP rank, DP coordinator), to say which one died and how.
    engine_processes: list[BaseProcess] = field(default_factory=list)
    # In-flight requests: unique engine request id → the id the client sees ("generate-tokens-<client id>"), and
    # that id → its engine ids. Clients may reuse an id; each request still gets its own engine id, so one client
    # leaving (or an abort by engine id) ends only its own request.
    live: dict[str, str] = field(default_factory=dict)
    by_client: dict[str, set[str]] = field(default_factory=dict)
    _seq: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    _openai: Any = None  # vLLM's OpenAI layer over the engine, built on first use (openai_layer)
    _openai_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _restore_error: str | None = None  # an API process: the control process's (``restore_error``)
    _slots: Any = None  # ``peers.slots``, and this process's first column in it
    _base: int = 0

    def __post_init__(self) -> None:
        f = self.engine.facts
        self.limits = Limits(vocab_size=f.vocab_size, max_model_len=f.max_model_len, max_num_seqs=f.max_num_seqs,
                             max_logprobs=f.max_logprobs, priority_scheduling=f.priority_scheduling,
                             min_tokens_refusal=min_tokens_refusal(f.stop_ids_outside_vocab, f.vocab_size))
        if self.limits.min_tokens_refusal:
            log.warning("%s", self.limits.min_tokens_refusal)
        self._idle.set()
        # The gauge reads the count when scraped: no lock taken twice on every request.
        INFLIGHT.set_function(lambda: self.inflight)
        # Each manager gets what it uses (the engine, its settings, narrow callbacks), never this object: the
        # arrows point one way, server -> weights -> engine.
        # Weight updates: one at a time, idempotent, cancellation-safe (app/weights/updates.py).
        self.weights = WeightManager(self.engine, self.settings.model, abort=self.abort,
                                     check_engine=self.check_engine)
        # LoRA adapters: registry and load/unload orchestration (app/weights/lora.py).
        self.adapters = LoraManager(self.engine, self.settings, check_engine=self.check_engine,
                                    inflight=lambda: self.inflight)
        # Pause/resume/update transitions: one at a time, in arrival order (app/server/control.py).
        self.control = ControlPlane(self.engine, self.weights, inflight=lambda: self.inflight)
        if self.api_process:
            return  # staging and AReaL's sync are the control process's alone (their routes are forwarded there)
        # Staged versions (Prime-RL's stage/commit): a commit is an update, in the control plane's order.
        self.staging = StagingManager(self.engine, self.settings, self.weights, self.control.guard)
        # AReaL's weight sync (xccl group, announced tensors, LoRA versions): app/weights/areal.py.
        self.areal = ArealSync(self.engine, self.weights, self.adapters, self.control.guard,
                               check_engine=self.check_engine)

    def join(self, peers: Peers) -> None:
        """Become one process of several: in-flight counts go to the shared slots, the state to and from the board."""
        from app.server.board import COLUMNS, PID

        self.peers = peers
        self._slots, self._base = peers.slots.slots, peers.slot * COLUMNS
        peers.slots.set(peers.slot, PID, os.getpid())
        self._drain_mark = self.total_finished()

    @property
    def weight_version(self) -> str:
        """The weight version being served (the weight manager keeps it and sets it on each update)."""
        return self.weights.version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        self.weights.relabel(version)

    @property
    def loras(self) -> dict[str, LoraEntry]:
        """Loaded LoRA adapters by name."""
        return self.adapters.entries

    @property
    def facts(self) -> ModelFacts:
        return self.engine.facts

    # ------------------------------------------------------------------ admission

    def check_engine(self) -> None:
        if self.engine.errored:
            raise ApiError(503, f"engine is dead: {self.engine_death_cause()}")

    def engine_error(self, e: BaseException, what: str, param_prefix: str = "", failed: str | None = None) -> ApiError:
        """The one mapping of an engine failure to an answer (the engine's translation: app/engine/errors.py): dead →
        503, input the engine refused → 400 (naming the parameter when vLLM does), anything else → 500 (logged; no
        stack trace reaches the client), with ``failed`` as its message when given."""
        e = self.engine.translate_error(e)
        if isinstance(e, ApiError):
            return e
        if isinstance(e, EngineDead):
            return ApiError(503, f"engine is dead: {self.engine_death_cause()}")
        if isinstance(e, EngineRejected):
            return ApiError(400, str(e), param=f"{param_prefix}{e.parameter}" if e.parameter else None)
        log.error("%s failed", what, exc_info=e)
        return ApiError(500, failed or f"{what} failed: {type(e).__name__}")

    def engine_death_cause(self) -> str:
        """Record (once) and return why the engine is dead: which engine process exited and how."""
        if self.engine_failure is None:
            self.engine_failure = {"time": time.time(), "cause": self._describe_death()}
        return str(self.engine_failure["cause"])

    def _describe_death(self) -> str:
        dead = []
        for p in self.engine_processes:
            code = p.exitcode
            if code is None:
                continue
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            dead.append(f"{p.name} (pid {p.pid}) {how}")
        if dead:
            return "; ".join(dead)
        return "the engine's output loop stopped (EngineCore unreachable)"

    def admit(self) -> None:
        """Gate for new generate requests: raises 503 when the server will not take new work."""
        if self.peers is not None:
            self.peers.refresh(self)  # an API process: the control process's latest word first
        self.check_engine()
        if self.shutting_down:
            raise ApiError(503, "server is shutting down; send the request to another replica.",
                           headers={"Retry-After": "5"})
        if self.draining:
            raise ApiError(503, "server is draining; send the request to another replica.",
                           headers={"Retry-After": "5"})
        self.weights.check_consistent()
        restore_error = self.restore_error
        if restore_error is not None:
            raise ApiError(503, f"{restore_error}; send the request to another replica.",
                           headers={"Retry-After": "5"})

    @property
    def restore_error(self) -> str | None:
        """Why the weights this replica last committed could not be restored at start (app/weights/restore.py)."""
        rec = self.weights.recorder
        return rec.restore_error if rec is not None else self._restore_error

    @property
    def not_ready_reason(self) -> str | None:
        """Why the server does not take new work right now, or None when it does."""
        if self.engine.errored:
            return "engine_dead"
        if self.shutting_down:
            return "shutting_down"
        if self.draining:
            return "draining"
        if self.weights.inconsistent is not None:
            return "weights_inconsistent"
        if self.restore_error is not None:
            return "weights_not_restored"
        if self.leaving:
            return "leaving_fleet"
        if not self.ready:
            return "starting"
        return None

    # ------------------------------------------------------------------ in-flight requests

    def enter(self, request_id: str, engine_base: str | None = None) -> str:
        """Count a request in flight under the id the client sees; returns its own, unique engine request id (made
        from ``engine_base``, default the client's id: an OpenAI call's prompts are ``cmpl-<id>-<i>``)."""
        self._seq += 1
        engine_id = f"{engine_base or request_id}-{self._seq:x}"
        self.live[engine_id] = request_id
        self.by_client.setdefault(request_id, set()).add(engine_id)
        self.local += 1
        self._idle.clear()
        if self._slots is not None:  # the other processes count it too (column order: app/server/board.py)
            self._slots[self._base] = self.local
            self._slots[self._base + 2] += 1
        return engine_id

    def leave(self, engine_id: str) -> None:
        self.local -= 1
        self.finished += 1
        client_id = self.live.pop(engine_id, None)
        if client_id is not None:
            ids = self.by_client.get(client_id)
            if ids is not None:
                ids.discard(engine_id)
                if not ids:
                    del self.by_client[client_id]
        if self._slots is not None:
            self._slots[self._base] = self.local
            self._slots[self._base + 1] = self.finished
        if self.local == 0:
            self._idle.set()

    @property
    def inflight(self) -> int:
        """Requests in flight on the whole server (this process's: ``local``)."""
        if self._slots is None:
            return self.local
        from app.server.board import INFLIGHT

        return self.peers.slots.total(INFLIGHT) if self.peers is not None else self.local

    def total_finished(self) -> int:
        if self.peers is None:
            return self.finished
        from app.server.board import FINISHED

        return self.peers.slots.total(FINISHED)

    @property
    def finished_since_drain(self) -> int:
        """Requests the server finished since the drain (or the shutdown) began."""
        return self.total_finished() - self._drain_mark

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight on the server; True if reached within ``timeout`` seconds."""
        if self.inflight == 0:
            return True
        if self.peers is None:
            try:
                await asyncio.wait_for(self._idle.wait(), max(timeout, 0.0))
                return True
            except TimeoutError:
                return False
        deadline = time.monotonic() + max(timeout, 0.0)
        while self.inflight:  # the API processes' counts are in shared memory: look again every 10 ms
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
        return True

    def resolve_ids(self, ids: list[str]) -> list[str]:
        """Engine ids of the in-flight requests named by ``ids``: a client id or the ``generate-tokens-`` id names
        every request that carries it; a unique engine id (``X-Engine-Request-Id``) names that one request."""
        out: dict[str, None] = {}
        for rid in ids:
            if rid in self.live:
                out[rid] = None
            for cand in (rid, *(prefix + rid for prefix in CLIENT_PREFIXES)):
                for eid in sorted(self.by_client.get(cand, ())):
                    out[eid] = None
        return list(out)

    async def abort(self, ids: list[str] | None = None) -> int:
        """Abort in-flight generate requests (all when ``ids`` is None); returns how many requests were hit.

        Aborted requests still answer: partial tokens with ``finish_reason: "abort"``.
        """
        targets = list(self.live) if ids is None else self.resolve_ids(ids)
        if targets and not self.engine.errored:
            await self.engine.abort(targets)
        if self.peers is not None:
            return len(targets) + await self.peers.abort(ids)
        return len(targets)

    def changed(self) -> None:
        """The server-wide state may have changed: with several API processes, publish it to them."""
        if self.peers is not None:
            self.peers.changed(self)

    async def settled(self) -> None:
        """With several API processes, return once each has applied the state published last (then none admits a
        request the new state refuses)."""
        if self.peers is not None:
            await self.peers.settle()

    # ------------------------------------------------------------------ drain

    async def leave_fleet(self, reason: str) -> float | None:
        """Out of Dynamo's discovery before refusing work: stop the child sidecar and wait until it has gone (its
        in-flight streams finished); new work is still admitted meanwhile. Seconds it took; None without one."""
        if self.sidecar is None:
            return None
        self.leaving = True
        self.changed()
        try:
            return await self.sidecar.withdraw(reason)
        finally:
            self.leaving = False
            self.changed()

    def rejoin_fleet(self) -> None:
        if self.sidecar is not None:
            self.sidecar.rejoin()

    def start_drain(self) -> None:
        if not self.draining:
            self.draining = True
            self.drain_started_at = time.time()
            self._drain_mark = self.total_finished()
            DRAINING.set(1)
            self.changed()

    def stop_drain(self) -> None:
        self.draining = False
        self.drain_started_at = None
        DRAINING.set(0)
        self.changed()

    def begin_shutdown(self) -> None:
        """SIGTERM: refuse new work from now on (not reversible); count what still finishes."""
        if not self.shutting_down:
            if not self.draining:
                self._drain_mark = self.total_finished()
            self.shutting_down = True
            self.ready = False
            DRAINING.set(1)
            self.control.end_lease()  # no resume of its own while the server stops
            self.changed()

    async def openai_layer(self) -> Any:
        """The engine adapter's OpenAI layer (app/engine/openai_layer.py), built once in a thread on first use: vLLM's
        serving modules take seconds to import, which neither start-up nor the event loop should pay."""
        async with self._openai_lock:
            if self._openai is None:
                loras = self.adapters.entries
                self._openai = await asyncio.to_thread(
                    self.engine.openai_layer, lambda: {n: e.handle for n, e in loras.items()},
                    MediaPolicy.from_settings(self.settings))
        return self._openai

    # ------------------------------------------------------------------ models

    def resolve_model(self, name: str | None) -> Any:
        """Map the request's ``model`` to the base model (None) or a loaded LoRA adapter's engine handle (what
        ``Engine.generate(lora=...)`` takes); unknown → 404."""
        if not name or name == self.facts.name or name == self.facts.path:
            return None
        return self.adapters.resolve(name).handle


# Where each part of AppState lives with several API processes (tests/test_unit_api_processes.py holds every field to
# one of them). Server-wide: the control process's, mirrored by every API process from the board
# (app/server/mirror.py); so are the parts of the managers made in ``__post_init__`` that the API processes read (the
# weights' version and consistency, the LoRA registry) and the engine adapter's pause record and prefix-cache salt.
SERVER_WIDE = frozenset({"started_at", "draining", "shutting_down", "ready", "engine_failure", "drain_started_at",
                         "sidecar", "leaving"})
PER_PROCESS = frozenset({"settings", "engine", "api_process", "peers", "local", "finished", "_drain_mark",
                         "engine_processes", "live", "by_client", "_seq", "_idle", "_openai", "_openai_lock",
                         "_restore_error", "_slots", "_base"})


async def get_state(request: Request) -> AppState:
    """FastAPI dependency: the AppState of the app serving this request. ``async`` on purpose: FastAPI runs a plain
    ``def`` dependency in a worker thread, a thread hop per request that cost ~17% of the hot path under load."""
    state: AppState | None = getattr(request.app.state, "tito", None)
    if state is None:
        raise not_started(request)
    if state.peers is not None:
        state.peers.refresh(state)  # an API process of several: the control process's latest word
    return state


def not_started(request: Request) -> ApiError:
    """The answer of every route that needs the engine before it is up (app/server/startup.py)."""
    return not_started_app(request.app)


def not_started_app(app: Any) -> ApiError:
    failed = getattr(app.state, "start_error", None)
    if failed:
        return ApiError(503, f"server failed to start: {failed}")
    return ApiError(503, "server is starting", headers={"Retry-After": "5"})
