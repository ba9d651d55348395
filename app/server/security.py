"""Who may call what: an API key for the data plane and one for the admin plane, checked before any route runs.

Every request path falls in one of three planes, with **default deny**: a route nobody listed here is admin.

- open: ``/health``, ``/liveness``, ``/ready``, ``/version``, the OpenAPI docs, and ``/metrics`` (unless
  ``--protect-metrics``, which moves it to the data plane);
- data: ``/inference/*`` and ``/v1/*`` (generation, model list), except the LoRA load/unload and abort routes
  that sit under those prefixes, and vLLM's ``/tokenize`` and ``/detokenize``;
- admin: everything else (pause, resume, weights, broadcaster, LoRA, drain, abort-all, sleep, ...).

Keys: ``--api-key`` guards the data plane, ``--admin-api-key`` the admin plane. A key of ``EMPTY`` (what Prime-RL
and the OpenAI client send when there is none) or an empty string means "no key". With only ``--api-key`` set the
admin plane requires that same key (never open: that is vLLM's hole); with an admin key set, the data key never
opens an admin route, while the admin key also opens the data plane. Keys are compared in constant time on their
SHA-256 digests, so neither content nor length leaks through timing.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from dataclasses import dataclass
from enum import StrEnum

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from app.core.protocol import error_body, json_response
from app.core.settings import Settings

log = logging.getLogger("tito.security")

OPEN_PATHS = frozenset({"/health", "/liveness", "/ready", "/version", "/openapi.json", "/docs",
                        "/docs/oauth2-redirect", "/redoc"})
METRICS_PATH = "/metrics"
DATA_PREFIXES = ("/inference/", "/v1/")
# Under a data prefix but admin: the LoRA routes make the server read files; abort with ``{}`` aborts everyone's
# requests (vLLM puts it behind --api-key; tito treats every abort route as admin); the adapter registry lists
# server paths.
ADMIN_IN_DATA = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/lora_adapters",
                           "/inference/v1/abort_requests"})
# vLLM's (de)tokenize routes sit at the root but are data plane: clients send text, no server state changes.
DATA_PATHS = frozenset({"/tokenize", "/detokenize"})
NO_KEY = ("", "EMPTY")


class Plane(StrEnum):
    OPEN = "open"
    DATA = "data"
    ADMIN = "admin"


def classify(path: str, protect_metrics: bool = False) -> Plane:
    """The plane of a request path. Anything not known to be open or data is admin."""
    if path in OPEN_PATHS:
        return Plane.OPEN
    if path == METRICS_PATH:
        return Plane.DATA if protect_metrics else Plane.OPEN
    # Starlette routes on this same decoded path and does not collapse "/v1/../pause", so a path that starts with
    # a data prefix can only reach a route declared under that prefix.
    if path in DATA_PATHS or path.startswith(DATA_PREFIXES) and path.rstrip("/") not in ADMIN_IN_DATA:
        return Plane.DATA
    return Plane.ADMIN


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _normalize(key: str | None) -> str | None:
    if key is None or key.strip() in NO_KEY:
        return None
    return key


@dataclass(frozen=True)
class Keys:
    """Digests of the keys each plane accepts; ``None`` means the plane needs no key."""

    data: tuple[bytes, ...] | None
    admin: tuple[bytes, ...] | None
    admin_is_separate: bool

    @classmethod
    def from_settings(cls, settings: Settings) -> Keys:
        return cls.of(settings.api_key, settings.admin_api_key)

    @classmethod
    def of(cls, api_key: str | list[str] | None, admin_api_key: str | None) -> Keys:
        """``api_key``: one key or several (vLLM's ``--api-key`` takes several: any of them is accepted)."""
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        api = [k for k in (_normalize(k) for k in keys) if k is not None]
        admin = _normalize(admin_api_key)
        data = tuple(_digest(k) for k in (*api, admin) if k is not None) if api else None
        if admin is not None:
            return cls(data=data, admin=(_digest(admin),), admin_is_separate=True)
        return cls(data=data, admin=tuple(_digest(k) for k in api) if api else None, admin_is_separate=False)

    def required(self, plane: Plane) -> tuple[bytes, ...] | None:
        if plane is Plane.OPEN:
            return None
        return self.data if plane is Plane.DATA else self.admin

    @property
    def any(self) -> bool:
        return self.data is not None or self.admin is not None


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of the first ``Authorization: Bearer <token>`` header, or None."""
    for k, v in headers:
        if k == b"authorization":
            scheme, _, token = v.decode("latin-1").strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return None
            return token.strip()
    return None


def matches(token: str, accepted: tuple[bytes, ...]) -> bool:
    """Constant-time: every accepted digest is compared, whatever matched first."""
    given = _digest(token)
    ok = False
    for want in accepted:
        ok |= hmac.compare_digest(given, want)
    return ok


class ApiKeyAuth:
    """Pure-ASGI middleware: 401 in vLLM's error envelope, with ``WWW-Authenticate: Bearer``, before any route."""

    def __init__(self, app: ASGIApp, keys: Keys, protect_metrics: bool = False) -> None:
        self.app = app
        self.keys = keys
        self.protect_metrics = protect_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not self.keys.any:
            await self.app(scope, receive, send)
            return
        message = refusal(self.keys, scope, classify(scope.get("path", ""), self.protect_metrics))
        if message is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await send_unauthorized(send, message)


def refusal(keys: Keys, scope: Scope, plane: Plane) -> str | None:
    """Why a request to ``plane`` is refused (logged), or None when its key opens it. Shared by the middleware and
    the generate route's lean path (routers/generate.py), which checks the data plane itself."""
    accepted = keys.required(plane)
    if accepted is None:
        return None
    token = bearer_token(scope.get("headers", []))
    if token is not None and matches(token, accepted):
        return None
    message = _why(keys, plane, token)
    client = scope.get("client")
    log.info("401 %s %s from %s: %s", scope.get("method", "WS"), scope.get("path", ""),
             client[0] if client else "?", message)
    return message


async def send_unauthorized(send: Send, message: str) -> None:
    resp = json_response(error_body(401, message), 401, {"WWW-Authenticate": "Bearer"})
    await send({"type": "http.response.start", "status": 401, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})


def _why(keys: Keys, plane: Plane, token: str | None) -> str:
    if token is None:
        return f"this {plane.value} route needs an API key: send 'Authorization: Bearer <key>'."
    if plane is Plane.ADMIN and keys.admin_is_separate and keys.data and matches(token, keys.data):
        return "this is an admin route: the data-plane API key does not open it; use the admin API key."
    return "invalid API key."


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def install_security(app: FastAPI, settings: Settings) -> None:
    """Add the key check to ``app`` (outermost of the middleware added so far) and warn about open planes."""
    keys = Keys.from_settings(settings)
    app.add_middleware(ApiKeyAuth, keys=keys, protect_metrics=settings.protect_metrics)
    if not _is_loopback(settings.host):
        if keys.admin is None:
            log.warning("binding %s with no API key: anyone who can reach it can pause the server and load weights "
                        "(set --admin-api-key and --api-key)", settings.host)
        elif keys.data is None:
            log.warning("binding %s with no --api-key: the data plane (/inference, /v1) is open", settings.host)
    if settings.allow_any_weight_path:
        log.warning("--allow-any-weight-path: admin callers may make the server read weights from any path")
