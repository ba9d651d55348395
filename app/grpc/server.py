"""``tito serve --grpc-port``: a ``grpc.aio`` server in tito's process, beside the HTTP server, on the same engine
and ``AppState``: smg's ``VllmEngine`` service (``app/grpc/servicer.py``), vLLM's native ``vllm.Control`` and
``vllm.Inference`` (``app/grpc/vllm_native.py``, what Dynamo's vLLM sidecar drives), the standard
``grpc.health.v1`` service and server reflection.

Started by the lifespan once the engine is up and stopped by it before the engine is, after the SIGTERM drain
(``app/server/lifecycle.py``) has let the in-flight requests of both transports finish: while the drain runs, the
listener stays open and new gRPC work gets ``UNAVAILABLE`` (HTTP: 503), health ``NOT_SERVING``.

Security as on HTTP: with ``--api-key`` every ``VllmEngine`` call needs ``authorization: Bearer <key>`` metadata
(``UNAUTHENTICATED`` otherwise); health, the engine's ``HealthCheck`` and reflection stay open, as ``/health`` does.
The vLLM services' own rule (loopback peers need no key: the sidecar sends none) is in ``app/grpc/vllm_native.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from app.grpc import vllm_native as grpc_vllm
from app.grpc.servicer import TitoEngineServicer
from app.grpc.status import GrpcCall
from app.server.lifecycle import CLOSE_GRACE_S
from app.server.security import Keys, bearer_token, matches
from app.server.state import AppState

log = logging.getLogger("tito.grpc")

ENGINE_SERVICE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
HEALTH_SERVICE = "grpc.health.v1.Health"
OPEN_METHODS = frozenset({f"/{ENGINE_SERVICE}/HealthCheck"})
# Services grpc.health.v1 answers for ("" is the whole server); each follows tito's readiness.
HEALTH_SERVICES = frozenset({"", ENGINE_SERVICE, *grpc_vllm.SERVICES})
# How often a health Watch stream looks at the server's state.
WATCH_INTERVAL_S = 0.5

# vLLM's own gRPC launcher's options: no message size cap (long prompts and logprobs), and clients (the smg gateway)
# may keep idle connections alive with pings without being cut off for "too many pings".
_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 10000),
    ("grpc.keepalive_permit_without_calls", True),
    # gRPC sets SO_REUSEPORT by default: a second server on a taken port would bind silently and share its traffic.
    ("grpc.so_reuseport", 0),
]


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """The data-plane key check of ``app/server/security.py`` for gRPC calls."""

    def __init__(self, keys: Keys) -> None:
        self.accepted = keys.data

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        method: str = details.method  # type: ignore[attr-defined]
        if (self.accepted is None or method in OPEN_METHODS
                or not method.startswith(f"/{ENGINE_SERVICE}/")):
            return await continuation(details)
        md = details.invocation_metadata or ()  # type: ignore[attr-defined]
        token = bearer_token([(str(k).encode(), str(v).encode("latin-1", "replace")) for k, v in md])
        if token is not None and matches(token, self.accepted):
            return await continuation(details)
        message = ("this call needs an API key: send 'authorization: Bearer <key>' metadata."
                   if token is None else "invalid API key.")
        log.info("UNAUTHENTICATED gRPC %s: %s", method, message)
        GrpcCall(method.rsplit("/", 1)[-1]).done(grpc.StatusCode.UNAUTHENTICATED, 401)

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        return grpc.unary_unary_rpc_method_handler(deny)


class TitoHealth(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1``: SERVING exactly when tito's ``/ready`` is 200 (not starting, draining, shutting down, and
    the engine alive), for the whole server ("") and each service (VllmEngine, vllm.Control, vllm.Inference)."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    def _status(self) -> int:
        return health_pb2.HealthCheckResponse.SERVING if self.state.not_ready_reason is None \
            else health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(self, request: health_pb2.HealthCheckRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        if request.service not in HEALTH_SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=self._status())

    async def Watch(self, request: health_pb2.HealthCheckRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        if request.service not in HEALTH_SERVICES:
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            return
        last = None
        while True:  # ends when the client goes away or the server stops (the call is cancelled)
            status = self._status()
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            await asyncio.sleep(WATCH_INTERVAL_S)


class GrpcServer:
    """The gRPC listener of one tito process."""

    def __init__(self, state: AppState) -> None:
        s = state.settings
        self.address = f"{s.host}:{s.grpc_port}"
        keys = Keys.from_settings(s)
        # Without keys both interceptors pass every call: left out, so no call pays their two coroutines.
        interceptors = [ApiKeyInterceptor(keys), grpc_vllm.VllmKeyInterceptor(keys, s.grpc_trust_loopback)] \
            if keys.any else []
        self.kind = s.grpc_server
        if s.grpc_server == "native":
            import pygrpc_native.aio

            self.server = pygrpc_native.aio.server(options=_OPTIONS, interceptors=interceptors)
        else:
            self.server = grpc.aio.server(options=_OPTIONS, interceptors=interceptors)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(TitoEngineServicer(state), self.server)
        vllm_services = grpc_vllm.add_services(self.server, state)
        health_pb2_grpc.add_HealthServicer_to_server(TitoHealth(state), self.server)
        reflection.enable_server_reflection((ENGINE_SERVICE, *vllm_services, HEALTH_SERVICE, reflection.SERVICE_NAME),
                                            self.server)

    async def start(self) -> None:
        try:
            self.server.add_insecure_port(self.address)
        except RuntimeError as e:
            raise RuntimeError(f"cannot bind the gRPC port {self.address}: {e}") from None
        await self.server.start()
        log.info("gRPC (VllmEngine, vllm.Control, vllm.Inference, grpc.health.v1, reflection) on %s, %s server",
                 self.address, self.kind)

    async def stop(self, grace: float) -> None:
        """Stop listening; calls still running get ``grace`` seconds (the drain has already waited for them)."""
        await self.server.stop(grace)
        log.info("gRPC server stopped")


class GrpcService:
    """The gRPC server as a start-up service (app/server/startup.py): it starts once the engine is up and warm, and
    stops before the engine goes down."""

    name = "gRPC server"

    def __init__(self) -> None:
        self.server: GrpcServer | None = None

    async def start(self, state: AppState) -> None:
        server = GrpcServer(state)
        await server.start()
        self.server = server

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(CLOSE_GRACE_S)  # the SIGTERM drain already waited for its calls
            self.server = None
