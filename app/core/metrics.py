"""tito's own Prometheus families (the engine's ``vllm:*`` families live on the same default registry).

Defined once here, every family of tito's, so every module records into the same objects and the whole set is
read in one place.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, Info, values
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class LiveGauge(Gauge):
    """A gauge of the server's state, set by the process that holds that state: in this process's memory also in
    prometheus_client's multiprocess mode (several API processes, app/server/api_processes.py), where every other
    family is summed over the processes' files and the control process reports these beside them (routers/metrics.py).
    A file-backed gauge there would keep a removed label set, and report every process's idea of the state."""

    def _metric_init(self) -> None:
        self._value = values.MutexValue(self._type, self._name, self._name, self._labelnames, self._labelvalues,
                                        self._documentation)

    def remove(self, *labelvalues: object) -> None:
        with warnings.catch_warnings():  # prometheus_client warns of file-backed values, which these are not
            warnings.simplefilter("ignore")
            super().remove(*labelvalues)


INFLIGHT = LiveGauge("tito_inflight_requests", "Generate requests in flight")
REQUESTS = Counter("tito_requests_total", "HTTP requests by route and status", ["route", "status"])
REJECTED = Counter("tito_rejected_requests_total", "Requests refused with a 4xx before reaching the engine",
                   ["reason"])
DRAINING = LiveGauge("tito_draining", "1 while the server is draining")
PAUSED = LiveGauge("tito_paused", "1 while generation is paused")
PAUSE_LEASE_EXPIRED = Counter("tito_pause_lease_expired_total", "Pauses whose lease ran out with no control call, "
                              "by outcome: resumed by tito, or refused (weights inconsistent)", ["outcome"])
WEIGHT_UPDATES = Counter("tito_weight_updates_total", "Weight updates by source and outcome", ["source", "outcome"])
WEIGHT_UPDATE_SECONDS = Histogram("tito_weight_update_seconds", "Seconds per successful weight update", ["source"],
                                  buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
WEIGHTS_INCONSISTENT = LiveGauge("tito_weights_inconsistent",
                             "1 while the weights are a mix of versions after a failed update (generation paused)")
WEIGHT_VERSION = Info("tito_weight_version", "Current weight version label")
LORA_LOADS = Counter("tito_lora_loads_total", "LoRA adapter loads by kind and outcome", ["kind", "outcome"])
LORA_LOAD_SECONDS = Histogram("tito_lora_load_seconds", "Seconds per successful LoRA adapter load",
                              buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
# Staged weight versions (app/weights/staging.py).
STAGED = LiveGauge("tito_staged_versions", "Weight versions staged and not yet committed")
STAGED_VERSION = LiveGauge("tito_staged_version", "1 for each staged version (at most --max-staged-versions)",
                       ["version", "mode"])
STAGE_UPLOADS = LiveGauge("tito_stage_uploads_in_progress", "Chunked and streaming stage uploads not yet finalized")
STAGES = Counter("tito_stages_total", "Stage calls that completed a staged version, by transport, mode and outcome",
                 ["transport", "mode", "outcome"])
STAGE_BYTES = Counter("tito_stage_bytes_total", "Bytes of staged artifacts, by transport", ["transport"])
STAGE_SECONDS = Histogram("tito_stage_check_seconds", "Seconds to read, check and prepare a staged version",
                          buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
DELTA_ELEMENTS = Counter("tito_delta_elements_total", "Weight elements changed by committed deltas")
# The control plane (app/server/control.py) and the loop every HTTP and gRPC call shares: where a control call's time
# goes under load (its turn, the engine's part, and the wait behind work already queued in the API process).
CONTROL_SECONDS = Histogram("tito_control_seconds", "Seconds per control transition (pause, resume, "
                            "reset_prefix_cache, weight update) by call and part: queued (waiting for its turn) or "
                            "run (the transition itself, engine calls included)", ["call", "part"],
                            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
                                     300))
LOOP_LAG = Histogram("tito_event_loop_lag_seconds", "How late the API process's event loop runs a timer, sampled "
                     "every 100 ms: what any request waits behind the work already queued on the loop",
                     buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
# The gRPC services (app/grpc/status.py).
GRPC_REQUESTS = Counter("tito_grpc_requests_total", "gRPC calls by method and status code", ["method", "code"])


# The families above that live in the state-holding process's memory (``LiveGauge``, and an Info, which
# prometheus_client never writes to a file): the control process reports them beside the processes' files.
LIVE = (INFLIGHT, DRAINING, PAUSED, WEIGHTS_INCONSISTENT, WEIGHT_VERSION, STAGED, STAGED_VERSION, STAGE_UPLOADS)


# --------------------------------------------------------------------------------------------------- request counting

_REJECT_REASONS = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "unprocessable",
    429: "too_many_requests",
}


def reject_reason(status: int) -> str:
    """A bounded label for a 4xx answer."""
    return _REJECT_REASONS.get(status, "other_4xx")


# (route, status) -> the counters one answer moves, resolved once: ``labels()`` takes a lock and builds a key per call.
# Bounded as the labels are: route templates and "unmatched", HTTP statuses.
_COUNTERS: dict[tuple[str, int], tuple[Any, ...]] = {}


def count_answer(route: str, status: int) -> None:
    """One answer: ``tito_requests_total{route,status}``, and ``tito_rejected_requests_total{reason}`` for a 4xx."""
    counters = _COUNTERS.get((route, status))
    if counters is None:
        counters = (REQUESTS.labels(route=route, status=str(status)),)
        if 400 <= status < 500:
            counters += (REJECTED.labels(reason=reject_reason(status)),)
        _COUNTERS[(route, status)] = counters
    for c in counters:
        c.inc()


_GRPC_COUNTERS: dict[tuple[str, str], Any] = {}


def count_grpc(method: str, code: str) -> None:
    """One gRPC call in ``tito_grpc_requests_total{method,code}``, its child resolved once as ``count_answer``'s."""
    counter = _GRPC_COUNTERS.get((method, code))
    if counter is None:
        counter = _GRPC_COUNTERS[(method, code)] = GRPC_REQUESTS.labels(method, code)
    counter.inc()


def _route_label(scope: Scope) -> str:
    # FastAPI puts the matched route in the scope: label by its template (``/v1/models``), never by the raw path,
    # so a client cannot blow up the label set. Unmatched paths share one label.
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class StatusSend:
    """An ASGI ``send`` that remembers the answer's status and calls ``on_last(status)`` once, just before the last
    chunk of the body goes out. Shared by the request counter here and the request log (app/server/reqlog.py)."""

    __slots__ = ("send", "status", "done", "on_last")

    def __init__(self, send: Send, status: int, on_last: Callable[[int], None] | None = None) -> None:
        self.send = send
        self.status = status  # until the answer starts: what a request that ends without one counts as
        self.done = False
        self.on_last = on_last

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
        elif kind == "http.response.body" and not message.get("more_body", False) and not self.done:
            self.done = True
            if self.on_last is not None:
                self.on_last(self.status)
        await self.send(message)


class HttpMiddleware:
    """A pure-ASGI middleware's head: HTTP requests go to ``http``, every other scope (lifespan) passes through.
    Shared by the request counter here, the request log (app/server/reqlog.py) and the body limit (tito/main.py)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class RequestMetrics(HttpMiddleware):
    """Pure-ASGI middleware: ``tito_requests_total{route,status}``, and ``tito_rejected_requests_total{reason}``
    for every 4xx. Outermost, so it also counts answers given by other middleware (413 from the body limit).

    A request is counted just before the last chunk of its answer is sent, so a client that has its answer and then
    scrapes ``/metrics`` always finds it counted. A request that ends without an answer is counted as it ends."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        def count(status: int) -> None:
            count_answer(_route_label(scope), status)

        watched = StatusSend(send, 500, count)
        try:
            await self.app(scope, receive, watched)
        finally:
            if not watched.done:
                watched.done = True
                count(watched.status)
