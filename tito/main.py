"""``create_app``: the FastAPI application, its lifespan (engine start/stop) and error handling."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import __version__
from app.core.metrics import HttpMiddleware, RequestMetrics
from app.core.protocol import (
    GENERATE_PATH,
    ApiError,
    GenerateRequest,
    content_length_refusal,
    error_body,
    errors_to_api_error,
    json_response,
    send_api_error,
    status_phrase,
)
from app.core.settings import Settings
from app.engine.adapter import Engine
from app.server.security import install_security
from app.server.state import AppState
from app.weights.delta_check import stop_process as stop_staging_process

log = logging.getLogger("tito")


# A stop signal to tito's whole process group (Ctrl-C in a terminal, systemd's default control-group stop) reaches the
# EngineCore too, which can exit before tito's own handler has run: an engine that stops within this long of a stop
# signal to tito is part of the shutdown, not a death.
STOP_SIGNAL_GRACE_S = 1.0


async def _watch_engine(app: FastAPI, state: AppState, interval: float = 0.1) -> None:
    """Notice a dead EngineCore at once (vLLM only raises on the next call), record when and why, and by default
    exit non-zero after a short grace so a supervisor restarts the server."""
    while not state.engine.errored:
        await asyncio.sleep(interval)
    cause = state.engine_death_cause()
    state.ready = False
    if state.sidecar is not None and state.sidecar.wanted:
        # Out of discovery before anything else: nothing behind this worker any more.
        log.warning("engine stopped (%s): leaving the fleet", cause)
        await state.sidecar.withdraw("engine dead")
    deadline = time.monotonic() + STOP_SIGNAL_GRACE_S
    while not (state.shutting_down or app.state.stop_signalled) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if state.shutting_down or app.state.stop_signalled:
        # E.g. Ctrl-C in a terminal reaches the EngineCore too; the shutdown under way finishes the job.
        log.warning("engine stopped during shutdown: %s", cause)
        return
    log.error("engine is dead: %s", cause)
    settings = state.settings
    request_exit = getattr(app.state, "request_exit", None)
    if not settings.exit_on_engine_death or request_exit is None:
        log.error("staying up for inspection: every request gets 503 until the server is restarted")
        return
    log.error("exiting with code 1 in %.1fs (--exit-on-engine-death)", settings.engine_death_exit_delay)
    await asyncio.sleep(settings.engine_death_exit_delay)
    request_exit(1)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start: an injected engine is brought up before serving (tests); tito's own engine starts in the background
    after uvicorn has bound the port (app/server/startup.py), and routes answer 503 "starting" until it is up.
    Stop: other services, then in-flight requests are aborted, then the engine."""
    from app.server.startup import bring_up, start_engine, stop_services

    app.state.tito = None
    app.state.starting_state = None
    app.state.engine_build = None
    engine: Engine | None = app.state.engine_override
    owns_engine = engine is None
    starter: asyncio.Future[AppState] | None = None
    watcher: asyncio.Future[None] | None = None

    def watch(task: asyncio.Future[AppState]) -> None:
        nonlocal watcher
        if not task.cancelled() and task.exception() is None:
            watcher = asyncio.ensure_future(_watch_engine(app, task.result()))

    sidecar = app.state.sidecar
    if sidecar is not None:
        # Starts Dynamo's sidecar once the server is ready (its weights restored), restarts it if it dies.
        sidecar.start(lambda: app.state.tito is not None and app.state.tito.not_ready_reason is None)
    try:
        if engine is None:
            starter = asyncio.ensure_future(start_engine(app))
            starter.add_done_callback(watch)
        else:
            watcher = asyncio.ensure_future(_watch_engine(app, await bring_up(app, engine)))
        yield
    finally:
        state: AppState | None = app.state.tito or app.state.starting_state
        if state is not None:
            state.begin_shutdown()
        if watcher is not None:
            watcher.cancel()
        if sidecar is not None:  # out of discovery before the engine goes (done already after a SIGTERM drain)
            await sidecar.withdraw("shutdown")
            sidecar.stop_now()
        build = app.state.engine_build
        if build is not None and not build.done():
            log.info("shutting down during start-up: waiting for the engine being built, to stop it")
            await asyncio.gather(build, return_exceptions=True)
        if starter is not None and not starter.done():
            starter.cancel()
            await asyncio.gather(starter, return_exceptions=True)
        await stop_services(app)
        if state is not None and state.inflight and not state.engine.errored:
            log.info("shutting down: aborting %d request(s) still in flight", state.inflight)
            await state.abort()
        if owns_engine and build is not None and build.done() and not build.cancelled() \
                and build.exception() is None:
            build.result().shutdown()
            log.info("engine shut down")
        stop_staging_process()


class BodyLimit(HttpMiddleware):
    """Refuse bodies over the limit with 413 before reading them (Content-Length) or while reading (chunked)."""

    def __init__(self, app: ASGIApp, limit: int, paths: dict[str, int] | None = None) -> None:
        super().__init__(app)
        self.default = limit
        self.paths = paths or {}  # routes with a limit of their own (staged weight uploads)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.paths.get(scope["path"], self.default)
        for k, v in scope["headers"]:
            if k == b"content-length":
                refused = content_length_refusal(v, limit)
                if refused is not None:
                    await send_api_error(send, refused)
                    return
                await self.app(scope, receive, send)
                return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    # An HTTPException, not ApiError: FastAPI's body parsing turns any other error into a 400.
                    raise StarletteHTTPException(413, f"request body exceeds the limit of {limit} bytes.")
            return msg

        await self.app(scope, counted, send)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return errors_to_api_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return json_response(error_body(exc.status_code, detail, type=status_phrase(exc.status_code)),
                             exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        # Never leak a stack trace to the client; it goes to the log.
        log.exception("unhandled error")
        return json_response(error_body(500, f"internal error: {type(exc).__name__}"), 500)


class TitoApp(FastAPI):
    """The FastAPI app, with the generate route's lean path in front of it: ``POST
    /inference/v1/generate`` goes straight to ``routers.generate_lean.Lean``, which does what the middleware below and
    FastAPI's routing do for that route, in one layer; every other request takes the stack. A middleware added after
    ``create_app`` (``--log-requests`` mounts the request log so) turns the lean path off, so that it sees every
    request: the route is then served through the stack, by the same code (``routers.generate.serve_generate``)."""

    lean: ASGIApp | None = None  # routers.generate_lean.Lean while no middleware was added after create_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lean = self.lean
        if lean is not None and scope["type"] == "http" and scope["path"] == GENERATE_PATH \
                and scope["method"] == "POST" and not scope.get("root_path"):
            await lean(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def add_middleware(self, middleware_class: Any, *args: Any, **kwargs: Any) -> None:
        if self.lean is not None:
            log.info("%s added after create_app: %s takes the middleware stack", getattr(
                middleware_class, "__name__", middleware_class), GENERATE_PATH)
            self.lean = None
        super().add_middleware(middleware_class, *args, **kwargs)


def create_app(settings: Settings | None = None, *, engine: Engine | None = None, lean: bool = True) -> TitoApp:
    """Build the app. ``engine`` injects an already-built engine (tests); otherwise the lifespan starts one.
    ``lean=False`` serves the generate route through the middleware stack too (tests hold both to the same bytes)."""
    from routers import ALL
    from routers.generate_lean import Lean

    settings = settings or Settings.build()
    docs: dict[str, Any] = ({"docs_url": None, "redoc_url": None, "openapi_url": None}
                            if settings.vllm_args.get("disable_fastapi_docs") else {})
    app = TitoApp(title="tito", version=__version__, lifespan=lifespan,
                  description="Token-in/token-out inference server for RL rollouts, on vLLM.", **docs)
    app.state.settings = settings
    app.state.engine_override = engine
    app.state.stop_signalled = False  # set by the server's signal handler (app/server/lifecycle.py)
    app.state.services = _services(settings)
    app.state.sidecar = None
    if settings.dynamo_namespace:
        from app.dynamo.supervisor import SidecarSupervisor

        app.state.sidecar = SidecarSupervisor(settings)  # Dynamo's vLLM sidecar, as a supervised child
    for r in ALL:
        app.include_router(r)
    _install_error_handlers(app)
    from routers.staging import STAGE_ROUTES

    # Weight bytes may be large: their routes take --max-stage-bytes (plus room for the multipart envelope).
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes,
                       paths={p: settings.max_stage_bytes + 65536 for p in STAGE_ROUTES})
    install_security(app, settings)  # API keys: before the body is read, inside the request counter
    app.add_middleware(RequestMetrics)  # counts every answer, the body limit's 413 too
    # vLLM's HTTP middleware arguments go around everything (a CORS preflight needs no key), generate included.
    lean = not _add_vllm_middleware(app, settings) and lean
    _add_schemas(app)
    if lean:
        app.lean = Lean(app)
    return app


def _add_vllm_middleware(app: FastAPI, settings: Settings) -> bool:
    """vLLM's ``--middleware``, ``--enable-request-id-headers`` and CORS arguments, as ``vllm serve`` applies them.
    Returns whether any was added."""
    import importlib
    import inspect

    v = settings.vllm_args
    added = False
    for path in v.get("middleware") or ():
        module, _, name = path.rpartition(".")
        imported: Any = getattr(importlib.import_module(module), name)
        if inspect.isclass(imported):
            app.add_middleware(cast(Any, imported))
        elif inspect.iscoroutinefunction(imported):
            app.middleware("http")(imported)
        else:
            raise ValueError(f"--middleware {path}: neither a class nor an async function")
        added = True
    if v.get("enable_request_id_headers"):
        from app.server.reqlog import RequestIdHeader

        app.add_middleware(RequestIdHeader)
        added = True
    if v.get("allowed_origins"):
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=v["allowed_origins"],
                           allow_credentials=v.get("allow_credentials", False),
                           allow_methods=v.get("allowed_methods", ["*"]), allow_headers=v.get("allowed_headers", ["*"]))
        added = True
    return added


def _services(settings: Settings) -> list[Any]:
    """Servers beside HTTP that start once the engine is up (app/server/startup.py ``Service``)."""
    services: list[Any] = []
    if settings.grpc_port:
        try:
            from app.grpc.server import GrpcService  # the `grpc` extra, only when asked for
        except ImportError as e:
            raise RuntimeError(f"--grpc-port needs the grpc extra (from a checkout: .venv/bin/pip install -e "
                               f"'.[grpc]'; from a wheel: pip install 'tito[grpc]'): {e}") from e
        if settings.grpc_server == "native":
            try:
                import pygrpc_native.aio  # noqa: F401  (checked before the engine starts, not after)
            except ImportError as e:
                raise RuntimeError(f"--grpc-server native (the default) needs pygrpc-native, in the grpc extra "
                                   f"(pip install 'tito[grpc]'), or use --grpc-server grpcio: {e}") from e
        services.append(GrpcService())
    return services


def _add_schemas(app: FastAPI) -> None:
    """Put the request models that routes parse themselves (from raw bytes, for speed) into the OpenAPI schema."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        from app.engine.openai_eval import request_schemas  # vLLM's request models of routers/openai.py

        models = {GenerateRequest.__name__: GenerateRequest.model_json_schema(
            ref_template="#/components/schemas/{model}"), **request_schemas()}
        for model_name, js in models.items():
            for name, sub in js.pop("$defs", {}).items():
                comps.setdefault(name, sub)
            comps[model_name] = js
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


__all__ = ["create_app", "lifespan"]
