"""vLLM's native gRPC services on tito's gRPC server: ``vllm.Control`` (``app/grpc/vllm_control.py``) and
``vllm.Inference`` (``app/grpc/vllm_inference.py``), beside smg's ``VllmEngine`` on the same ``--grpc-port``.

Trust boundary. The Dynamo sidecar runs beside the engine (pod-local) and sends no API key, so with tito's keys set:

- a call from a **loopback** peer (127.0.0.0/8, ::1, a unix socket) needs no key while ``--grpc-trust-loopback``
  (default on) — that is the sidecar's path;
- a call from any other peer needs ``authorization: Bearer <key>`` metadata: the admin key for ``vllm.Control``
  (pause, weights, LoRA, shutdown: tito's admin plane), the data key (or the admin key) for ``vllm.Inference``;
  UNAUTHENTICATED otherwise.

Without keys the services are open, as tito's HTTP planes are; gRPC binds ``--host`` (loopback by default).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from app.grpc.proto import vllm_control_pb2, vllm_control_pb2_grpc, vllm_inference_pb2, vllm_inference_pb2_grpc
from app.grpc.status import GrpcCall
from app.grpc.vllm_control import ControlServicer
from app.grpc.vllm_inference import InferenceServicer
from app.server.security import Keys, Plane, bearer_token, matches
from app.server.state import AppState

log = logging.getLogger("tito.grpc")

CONTROL_SERVICE = vllm_control_pb2.DESCRIPTOR.services_by_name["Control"].full_name
INFERENCE_SERVICE = vllm_inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
SERVICES = (CONTROL_SERVICE, INFERENCE_SERVICE)
_PLANES = {f"/{CONTROL_SERVICE}/": Plane.ADMIN, f"/{INFERENCE_SERVICE}/": Plane.DATA}


def add_services(server: grpc.aio.Server, state: AppState) -> tuple[str, ...]:
    """Register both services on ``server``; returns their names (for health and reflection)."""
    vllm_control_pb2_grpc.add_ControlServicer_to_server(ControlServicer(state), server)
    vllm_inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(state), server)
    return SERVICES


def is_loopback_peer(peer: str) -> bool:
    """``context.peer()`` of a loopback caller: ``ipv4:127.0.0.1:port``, ``ipv6:[::1]:port``, ``unix:...``."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind == "ipv4":
        host = rest.rpartition(":")[0]
    elif kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]")
    else:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


class VllmKeyInterceptor(grpc.aio.ServerInterceptor):
    """The key check for the two vLLM services (see the module docstring)."""

    def __init__(self, keys: Keys, trust_loopback: bool) -> None:
        self.keys = keys
        self.trust_loopback = trust_loopback

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        method: str = details.method  # type: ignore[attr-defined]
        plane = next((p for prefix, p in _PLANES.items() if method.startswith(prefix)), None)
        accepted = self.keys.required(plane) if plane is not None else None
        if accepted is None:
            return await continuation(details)
        md = details.invocation_metadata or ()  # type: ignore[attr-defined]
        token = bearer_token([(str(k).encode(), str(v).encode("latin-1", "replace")) for k, v in md])
        if token is not None and matches(token, accepted):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        if token is None:
            why = (f"this {plane.value if plane else ''} call needs an API key from a non-loopback peer: send "
                   "'authorization: Bearer <key>' metadata.")
        elif plane is Plane.ADMIN and self.keys.admin_is_separate and self.keys.data and matches(token, self.keys.data):
            why = "vllm.Control is tito's admin plane: the data-plane key does not open it; use the admin key."
        else:
            why = "invalid API key."
        return _peer_checked(handler, method, why, self.trust_loopback)


def _peer_checked(handler: Any, method: str, why: str, trust_loopback: bool) -> Any:
    """``handler`` run only for a trusted loopback peer; others get UNAUTHENTICATED (the peer is known only to the
    call's context, not to the interceptor)."""
    streaming = handler.unary_stream is not None
    behavior = handler.unary_stream if streaming else handler.unary_unary

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        peer = context.peer()
        if trust_loopback and is_loopback_peer(peer):
            return await behavior(request, context)
        log.info("UNAUTHENTICATED gRPC %s from %s: %s", method, peer, why)
        GrpcCall(method.rsplit("/", 1)[-1]).done(grpc.StatusCode.UNAUTHENTICATED, 401)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
    return make(checked, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
