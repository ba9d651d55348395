"""Start-up: the port answers from the first second, the engine starts behind it.

uvicorn binds its socket only once the lifespan's start-up part has returned, so the lifespan starts the engine in a
background task (``Engine.start`` blocks for tens of seconds: it runs in a thread) and returns at once. Until the
engine is up and warm, ``app.state.tito`` is None and every route says so: ``/health`` 503 ``{"status":
"starting"}``, ``/ready`` 503 reason ``starting``, ``/liveness`` 503, generate and admin routes 503 "server is
starting" with ``Retry-After``. If the engine cannot start, the cause is logged and the process exits non-zero.

Other servers that need the engine (a gRPC front end, ...) start once it is up and stop before it goes down: add them
to ``app.state.services`` (see ``Service``); ``start_services`` / ``stop_services`` run them.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import multiprocessing
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from app import __version__
from app.core import metrics
from app.engine.adapter import Engine
from app.engine.sampling import configured_limits
from app.server.api_processes import ApiPeers, ControlPeers
from app.server.board import UP
from app.server.state import AppState
from app.weights.record import WeightRecord, resolve_state_dir
from app.weights.restore import restore

if TYPE_CHECKING:
    from fastapi import FastAPI

    from app.core.settings import Settings

log = logging.getLogger("tito")

# Exit code when the engine could not start (the server had bound its port already).
START_FAILED = 3
START_PROGRESS_S = 30.0


class Service(Protocol):
    """Something that serves beside HTTP once the engine is up (e.g. a gRPC server)."""

    name: str

    async def start(self, state: AppState) -> None: ...

    async def stop(self) -> None: ...


class LoopLag:
    """Samples the event loop's lag into ``tito_event_loop_lag_seconds``: a timer's lateness is what every
    request's next step waits behind the callbacks already queued (under load, mostly streams' outputs)."""

    name = "event-loop lag monitor"
    interval = 0.1

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None

    async def start(self, state: AppState) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            metrics.LOOP_LAG.observe(max(0.0, loop.time() - due))

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()


def _services(app: FastAPI) -> list[Service]:
    if getattr(app.state, "loop_lag", None) is None:
        app.state.loop_lag = LoopLag()
    return [app.state.loop_lag, *getattr(app.state, "services", [])]


async def start_services(app: FastAPI, state: AppState) -> None:
    for svc in _services(app):
        await svc.start(state)
        log.info("%s started", svc.name)


async def stop_services(app: FastAPI) -> None:
    for svc in reversed(_services(app)):
        try:
            await svc.stop()
        except Exception:  # noqa: BLE001 - the others and the engine must still stop
            log.exception("stopping %s failed", svc.name)


async def bring_up(app: FastAPI, engine: Engine) -> AppState:
    """Everything after the engine exists: the state, warm-up, other services; publish the state (ready)."""
    settings: Settings = app.state.settings
    peers = getattr(app.state, "peers", None)
    if isinstance(peers, ApiPeers):
        return await _bring_up_api_process(app, engine, peers)
    state = AppState(settings=settings, engine=engine)
    if isinstance(peers, ControlPeers):
        state.join(peers)
        state.engine_processes = peers.plan.engine_processes()
    else:
        # The engine's processes (EngineCore per DP rank, DP coordinator), to name the one that died and how.
        state.engine_processes = multiprocessing.active_children()
    state.limits = configured_limits(state.limits, settings)
    app.state.starting_state = state  # for the lifespan's shutdown, should it come before the start ends
    state.sidecar = getattr(app.state, "sidecar", None)
    # The weights this replica last committed, before it reports ready or joins discovery (app/weights/record.py).
    state_dir = resolve_state_dir(settings.state_dir, settings.model, settings.port,
                                  default=app.state.engine_override is None)
    if state_dir is not None:
        state.weights.recorder = WeightRecord(state_dir, settings.model, volatile=[state.staging.root])
        await restore(state.weights, state.staging, state.weights.recorder)
        _say_where_weights_came_from(state.weights.recorder, settings.model)
    for module in settings.vllm_args.get("lora_modules") or ():  # vLLM's --lora-modules: adapters served from start
        entry = await state.adapters.load(module.name, module.path, inplace=False, trusted=True)
        log.info("LoRA adapter %s loaded from %s (--lora-modules)", entry.name, entry.path)
    if settings.warmup:
        await engine.warmup()
    await start_services(app, state)
    # Everything allocated so far (vLLM, torch, the app) lives for the whole run: move it out of the cyclic GC's
    # reach, so collections during serving only scan request garbage.
    gc.collect()
    gc.freeze()
    state.ready = True
    app.state.tito = state
    if isinstance(peers, ControlPeers):
        peers.start(state, lambda what: _api_process_died(app, state, what))  # the API processes serve from now
    log.info("tito %s serving %s on http://%s:%d%s", __version__, state.facts.name, settings.host, settings.port,
             f" ({len(peers.processes)} API processes)" if isinstance(peers, ControlPeers) else "")
    return state


async def _bring_up_api_process(app: FastAPI, engine: Engine, peers: ApiPeers) -> AppState:
    """An API process of several: its own state, mirroring the control process's server-wide part; it serves once
    the board says the server is ready (``ApiPeers.watch``)."""
    state = AppState(settings=app.state.settings, engine=engine, api_process=True)
    state.limits = configured_limits(state.limits, app.state.settings)
    state.join(peers)
    peers.refresh(state)
    app.state.starting_state = state
    await start_services(app, state)
    gc.collect()
    gc.freeze()
    peers.slots.set(peers.slot, UP, 1)
    return state


def _api_process_died(app: FastAPI, state: AppState, what: str) -> None:
    """One API process of several is gone: the server stops whole (its supervisor restarts it), never half."""
    log.error("%s: stopping the server (exit code 1)", what)
    state.begin_shutdown()  # the others refuse new work at once
    request_exit = getattr(app.state, "request_exit", None)
    if request_exit is not None:
        request_exit(1)


async def start_engine(app: FastAPI) -> AppState:
    """The background start: build the engine in a thread (the loop keeps answering), then ``bring_up``.

    A failure is logged with its cause and ends the process with ``START_FAILED``."""
    settings: Settings = app.state.settings
    t0 = time.monotonic()
    try:
        build = await _builder(app)
    except BaseException as e:
        _fail(app, f"engine failed to start after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}", e)
        raise
    building = app.state.engine_build = asyncio.ensure_future(asyncio.to_thread(build))
    try:
        await _say_progress(building, settings, t0)
        engine = await asyncio.shield(building)
    except BaseException as e:
        _fail(app, f"engine failed to start after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}", e)
        raise
    try:
        return await bring_up(app, engine)
    except asyncio.CancelledError:
        raise
    except BaseException as e:
        _fail(app, f"engine start-up failed: {type(e).__name__}: {e}", e)
        raise


async def _builder(app: FastAPI) -> Callable[[], Engine]:
    """How this process gets its engine: it starts it (one process), starts it for the API processes too (their
    control process), or, in an API process, connects to it once the control process has started it."""
    settings: Settings = app.state.settings
    peers = getattr(app.state, "peers", None)
    if isinstance(peers, ControlPeers):
        return functools.partial(Engine.start_control, settings, peers.plan,
                                 lambda address: peers.publish(launched=address), peers.processes)
    if isinstance(peers, ApiPeers):
        address = await peers.launched()
        return functools.partial(Engine.start, settings, peers.plan.client(peers.index, address))
    return functools.partial(Engine.start, settings)


async def _say_progress(building: asyncio.Future[Engine], settings: Settings, t0: float) -> None:
    """A line every ``START_PROGRESS_S`` while the engine starts: a compiled start at a real shape takes minutes the
    first time, and a silent log looks hung."""
    from app.engine.engine_setup import compiles

    while not (await asyncio.wait({building}, timeout=START_PROGRESS_S))[0]:
        log.info("engine still starting (%.0fs)%s", time.monotonic() - t0,
                 ": torch.compile compiles the model at its first start of a shape (minutes at 0.6B parameters and up; "
                 "vLLM caches it under VLLM_CACHE_ROOT, ~/.cache/vllm, for the next start); --enforce-eager skips "
                 "it" if compiles(settings) else "")


def _fail(app: FastAPI, message: str, exc: BaseException) -> None:
    if isinstance(exc, asyncio.CancelledError):
        return  # a shutdown during the start: not a failure
    log.error("%s", message, exc_info=exc)
    app.state.start_error = message
    peers = getattr(app.state, "peers", None)
    if isinstance(peers, ControlPeers):
        peers.publish(start_error=message)
    request_exit = getattr(app.state, "request_exit", None)
    if request_exit is not None:
        log.error("exiting with code %d", START_FAILED)
        request_exit(START_FAILED)


def _say_where_weights_came_from(recorder: WeightRecord, model: str) -> None:
    """One line at start naming the weights served and where they came from: a restart restores the last committed
    version (right for a fleet, a surprise on a laptop that expects --model's weights)."""
    done = recorder.restored
    if done is None:
        if recorder.restore_error is None:
            log.info("serving %s's own weights; weight updates committed from now on are recorded in %s and restored "
                     "at the next start (--state-dir off: never)", model, recorder.dir)
        return
    src = done.get("weights") or {}
    log.warning("serving weight version %s, restored from the weight record in %s (%s %s%s), not %s's own weights: "
                "the last version committed before this restart; start with --state-dir off, or remove %s, to "
                "serve --model's weights", done.get("weight_version"), recorder.dir, src.get("kind", "weights"),
                src.get("dir", ""), f" + {done['deltas']} delta(s)" if done.get("deltas") else "", model,
                recorder.path)
