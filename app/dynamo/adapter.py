"""tito behind Dynamo: its frontend serves OpenAI completions and chat through tito replicas, routes by KV cache,
and lists them for trainers (``GET /v1/rl/workers``).

Dynamo's frontend speaks its own request plane, never plain HTTP, so tito joins through the ``ai-dynamo-runtime``
bindings (optional extra ``dynamo``), as a small adapter process beside tito (``tito dynamo-register``, or started by
``tito serve --dynamo-namespace NS``). It serves two endpoints in ``<namespace>.<component>``:

- ``generate``: forwards token requests to tito's HTTP API (app/dynamo/wire.py translates). Dynamo's preprocessed
  shape (``token_ids``, ``sampling_options``, ``stop_conditions``, ``output_options``) is streamed as Dynamo chunks;
  a vLLM-shaped body (with ``sampling_params``) is posted as is and its JSON answer returned. The model card claims
  Chat + Completions when the model dir has tokenizer files (the frontend tokenizes), nothing (discovery only)
  without; with tito's ``--kv-events-port`` the engine's KV-cache events are relayed to Dynamo's KV router.
- ``rl``: answers ``{"method": "routes"}`` with ``{"status": "ok", "routes": [...], "admin_base_url": ...,
  "world_size": N}``, the contract the frontend's RL worker listing and Prime-RL's discovery read.

Health flows both ways: the adapter polls tito's ``/ready`` and, while tito drains, shuts down or its engine is
dead, marks itself not ready and takes its instances out of discovery (the frontend stops listing it); it puts them
back when tito is ready again, unregisters on shutdown, and exits when tito is gone. Dynamo's own canary checks go
through ``generate`` and so reach tito's engine.

Nothing here is imported by tito's server: tito runs without the extra.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from app.dynamo.wire import (
    CANARY,
    GENERATE_PATH,
    BadRequest,
    CardFacts,
    completion_usage,
    error_message,
    sse_events,
    to_dynamo_chunk,
    to_tito_request,
)

if TYPE_CHECKING:
    from app.core.settings import Settings

log = logging.getLogger("tito.dynamo")

# Dynamo's frontend lists live instances of this endpoint name (its DYN_RL_ENDPOINT default).
RL_ENDPOINT = "rl"
GENERATE_ENDPOINT = "generate"


class DynamoUnavailable(RuntimeError):
    """The ``dynamo`` extra is not installed."""


def dynamo_available() -> bool:
    """Is the extra installed? (Looks, without loading the runtime library into this process.)"""
    import importlib.util

    try:
        return importlib.util.find_spec("dynamo._core") is not None
    except ModuleNotFoundError:
        return False


@dataclass(frozen=True)
class DynamoConfig:
    tito_url: str  # where the adapter reaches tito
    namespace: str = "dynamo"
    component: str = "tito"
    admin_base_url: str | None = None  # advertised to trainers (default: tito_url)
    discovery_backend: str | None = None  # default: $DYN_DISCOVERY_BACKEND, else Dynamo's own default (etcd)
    request_plane: str | None = None  # default: $DYN_REQUEST_PLANE, else tcp
    world_size: int | None = None  # default: tito's tensor x pipeline x data parallel size
    poll_interval: float = 1.0
    startup_timeout: float = 900.0  # wait this long for tito to become healthy
    gone_timeout: float = 30.0  # exit after tito has been unreachable this long
    request_timeout: float = 600.0  # per forwarded generate request
    api_key: str | None = field(default=None, repr=False)  # tito's data-plane key (generate)
    admin_api_key: str | None = field(default=None, repr=False)  # tito's admin key (/server_info)

    @property
    def advertised_url(self) -> str:
        return (self.admin_base_url or self.tito_url).rstrip("/")

    def backend(self) -> str:
        return self.discovery_backend or os.environ.get("DYN_DISCOVERY_BACKEND") or "etcd"

    def plane(self) -> str:
        return self.request_plane or os.environ.get("DYN_REQUEST_PLANE") or "tcp"


# --------------------------------------------------------------------------------------------------- adapter


class DynamoAdapter:
    """Registers tito with Dynamo's runtime and keeps the registration in step with tito's health."""

    def __init__(self, cfg: DynamoConfig) -> None:
        self.cfg = cfg
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.AsyncClient(base_url=cfg.tito_url.rstrip("/"), timeout=cfg.request_timeout,
                                      headers=headers)
        self.info: dict[str, Any] = {}
        self.ready = False
        self.registered = True  # serve_endpoint registers the instances itself
        self._stop = asyncio.Event()
        self.runtime: Any = None
        self.endpoints: list[Any] = []
        self.kv_publishers: list[Any] = []

    # ------------------------------------------------------------------ request-plane handlers

    async def generate(self, request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """Dynamo's preprocessed token request → tito's streaming generate → Dynamo chunks.

        A client that leaves the frontend stops the request's context; the stream to tito is then closed at once
        (not at the next token: a paused or queued request sends none), and tito aborts it in the engine. tito's
        4xx becomes Dynamo's InvalidArgument (a 400 at the client); a 503 before any token (draining, shutting down,
        engine dead) becomes EngineShutdown, which the frontend migrates to another replica (``--migration-limit``).
        """
        from dynamo._core import EngineShutdown, InvalidArgument

        if isinstance(request, dict) and "sampling_params" in request:  # already tito-shaped: tito's JSON answer
            r = await self.http.post(GENERATE_PATH, json=dict(request, stream=False))
            yield r.json() if r.headers.get("content-type", "").startswith("application/json") else {
                "error": {"message": r.text, "code": r.status_code}}
            return
        rid = context.id() if context is not None else None
        try:
            body, headers = to_tito_request(request if isinstance(request, dict) else {}, rid)
        except BadRequest as e:
            raise InvalidArgument(str(e)) from None
        events = self._stream(body, headers)
        stopped = asyncio.ensure_future(context.async_killed_or_stopped()) if context is not None else None
        usage: dict[str, Any] | None = None
        finals: list[dict[str, Any]] = []
        try:
            while True:
                nxt = asyncio.ensure_future(anext(events))
                if stopped is not None:
                    await asyncio.wait([nxt, stopped], return_when=asyncio.FIRST_COMPLETED)
                    if not nxt.done():  # the client left: closing the stream makes tito abort the request
                        nxt.cancel()
                        await asyncio.gather(nxt, return_exceptions=True)
                        log.info("dynamo: request %s cancelled by the frontend; closing it in tito", rid)
                        return
                try:
                    event = await nxt
                except StopAsyncIteration:
                    break
                except BadRequest as e:
                    if 400 <= e.status < 500:
                        raise InvalidArgument(str(e)) from None
                    raise EngineShutdown(str(e)) from None
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as e:
                    # tito is gone (shut down between the discovery update and this request, or died mid-answer):
                    # as a 503 would, this lets the frontend migrate the request to another replica.
                    raise EngineShutdown(f"tito at {self.cfg.tito_url} is unreachable: {type(e).__name__}") from None
                if "error" in event:
                    err = event["error"]
                    yield {"token_ids": [], "index": 0, "finish_reason": "error",
                           "error": err.get("message") if isinstance(err, dict) else str(err)}
                    return
                if event.get("usage") and not event.get("choices"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    chunk = to_dynamo_chunk(choice)
                    if "finish_reason" in chunk:
                        finals.append(chunk)  # held back so the terminal chunk can carry the usage
                    else:
                        yield chunk
            for i, chunk in enumerate(finals):
                if usage and i == len(finals) - 1:
                    chunk["completion_usage"] = completion_usage(usage)
                yield chunk
        finally:
            if stopped is not None:
                stopped.cancel()
            await events.aclose()

    async def _stream(self, body: dict[str, Any], headers: dict[str, str]) -> AsyncGenerator[dict[str, Any], None]:
        async with self.http.stream("POST", GENERATE_PATH, json=body, headers=headers) as r:
            if r.status_code != 200:
                raise BadRequest(r.status_code, error_message(r.status_code, await r.aread()))
            async for event in sse_events(r):
                yield event

    def routes_answer(self) -> dict[str, Any]:
        routes = self.info.get("routes", {}).get("admin", [])
        return {"status": "ok", "routes": list(routes), "admin_base_url": self.cfg.advertised_url,
                "world_size": self.world_size, "model": self.info.get("model", {}).get("served_model_name")}

    async def rl(self, request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        method = request.get("method") if isinstance(request, dict) else None
        if method != "routes":
            yield {"status": "error", "method": method, "message": "the rl endpoint only answers method='routes'"}
            return
        yield self.routes_answer()

    # ------------------------------------------------------------------ tito side

    @property
    def world_size(self) -> int:
        if self.cfg.world_size:
            return self.cfg.world_size
        return int(self.info.get("parallelism", {}).get("world_size") or 1)

    async def tito_ready(self) -> bool | None:
        """True ready, False up but not taking work (draining, shutting down, dead engine), None unreachable."""
        try:
            r = await self.http.get("/ready", timeout=5.0)
        except httpx.HTTPError:
            return None
        return r.status_code == 200

    async def wait_for_tito(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout
        while not self._stop.is_set():
            if await self.tito_ready():
                key = self.cfg.admin_api_key or self.cfg.api_key
                r = await self.http.get("/server_info", timeout=10.0,
                                        headers={"Authorization": f"Bearer {key}"} if key else None)
                r.raise_for_status()
                self.info = r.json()
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"tito at {self.cfg.tito_url} not healthy after {self.cfg.startup_timeout:g}s")
            await asyncio.sleep(self.cfg.poll_interval)

    # ------------------------------------------------------------------ Dynamo side

    async def _set_ready(self, ready: bool) -> None:
        if ready == self.ready:
            return
        self.ready = ready
        self.runtime.set_health_status(ready)
        for ep in self.endpoints:
            try:
                if ready and not self.registered:
                    await ep.register_endpoint_instance()
                elif not ready and self.registered:
                    await ep.unregister_endpoint_instance()
            except Exception as e:  # noqa: BLE001 - keep polling; the next transition retries
                log.warning("dynamo (un)registration failed: %s", e)
        self.registered = ready
        log.info("dynamo: %s", "ready, listed" if ready else "not ready, unlisted")

    async def _watch(self) -> None:
        gone_since: float | None = None
        while not self._stop.is_set():
            state = await self.tito_ready()
            if state is None:
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > self.cfg.gone_timeout:
                    log.warning("dynamo: tito unreachable for %.0fs; unregistering and exiting", self.cfg.gone_timeout)
                    self.stop()
                    return
            else:
                gone_since = None
            await self._set_ready(bool(state))
            try:
                await asyncio.wait_for(self._stop.wait(), self.cfg.poll_interval)
            except TimeoutError:
                pass

    def stop(self) -> None:
        self._stop.set()

    async def _register(self, gen_ep: Any, facts: CardFacts) -> None:
        """The model card. With tokenizer files beside the weights it claims Chat + Completions on token input: the
        frontend tokenizes, applies the chat template, routes and detokenizes, tito generates. Without, it claims
        no OpenAI surface (ModelType.Empty): discovery only, as before."""
        from dynamo._core import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

        rc = ModelRuntimeConfig()
        rc.context_length = facts.context_length
        rc.max_num_seqs = facts.max_num_seqs
        rc.data_parallel_start_rank = 0
        rc.data_parallel_size = facts.data_parallel_size
        if facts.total_kv_blocks:
            rc.total_kv_blocks = facts.total_kv_blocks
        rc.enable_local_indexer = True
        rc.kv_event_publishing_enabled = bool(facts.kv_events)
        user_data = {"http_base_url": self.cfg.advertised_url, "generate_url": self.cfg.advertised_url + GENERATE_PATH}
        if facts.serves_text:
            await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, gen_ep, facts.path,
                                 facts.name, worker_type=WorkerType.Aggregated,
                                 kv_cache_block_size=facts.kv_block_size or None, runtime_config=rc,
                                 user_data=user_data)
        else:
            await register_model(ModelInput.Tokens, ModelType.Empty, gen_ep, facts.path, facts.name,
                                 worker_type=WorkerType.Aggregated, skip_model_assets=True,
                                 kv_cache_block_size=facts.kv_block_size or None, runtime_config=rc,
                                 user_data=user_data)

    def _relay_kv_events(self, gen_ep: Any, facts: CardFacts) -> list[Any]:
        """One relay per data-parallel rank: subscribe to the engine core's ZMQ KV-event publisher (tito
        ``--kv-events-port``) and forward its block stored/removed events, in the engine's block size, to Dynamo's
        KV router on the event plane."""
        if not facts.kv_events or not facts.kv_block_size:
            return []
        from dynamo._core import KvEventPublisher

        return [KvEventPublisher(gen_ep, kv_block_size=facts.kv_block_size, dp_rank=rank, enable_local_indexer=True,
                                 zmq_endpoint=endpoint, zmq_topic="")
                for rank, endpoint in sorted(facts.kv_events.items())]

    async def run(self) -> None:
        try:
            from dynamo._core import DistributedRuntime
        except ImportError as e:
            raise DynamoUnavailable("Dynamo support needs the extra: pip install 'tito[dynamo]'") from e

        await self.wait_for_tito()
        if self._stop.is_set():
            return
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self.runtime = DistributedRuntime(loop, cfg.backend(), cfg.plane())
        base = f"{cfg.namespace}.{cfg.component}"
        gen_ep = self.runtime.endpoint(f"{base}.{GENERATE_ENDPOINT}")
        rl_ep = self.runtime.endpoint(f"{base}.{RL_ENDPOINT}")
        self.endpoints = [gen_ep, rl_ep]
        facts = CardFacts.from_server_info(self.info)
        await self._register(gen_ep, facts)
        serving = [asyncio.ensure_future(gen_ep.serve_endpoint(self.generate, health_check_payload=CANARY)),
                   asyncio.ensure_future(rl_ep.serve_endpoint(self.rl))]
        self.ready = False
        watcher = asyncio.ensure_future(self._watch())
        self.kv_publishers = self._relay_kv_events(gen_ep, facts)
        log.info("dynamo: %s registered as %s in namespace %r (component %r, backend %s), admin_base_url=%s, "
                 "world_size=%d, context %d, KV blocks %d x %d tokens, KV events from %s", facts.name,
                 "chat+completions" if facts.serves_text else "discovery only (no tokenizer)", cfg.namespace,
                 cfg.component, cfg.backend(), cfg.advertised_url, self.world_size, facts.context_length,
                 facts.total_kv_blocks, facts.kv_block_size, sorted(facts.kv_events.values()) or "nowhere")
        try:
            done, _ = await asyncio.wait([watcher, *serving], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not watcher and t.exception() is not None:
                    log.error("dynamo endpoint stopped: %s", t.exception())
        finally:
            self.stop()
            watcher.cancel()
            for pub in self.kv_publishers:
                pub.shutdown()
            for ep in self.endpoints:
                try:
                    await asyncio.wait_for(ep.unregister_endpoint_instance(), 5.0)
                except Exception as e:  # noqa: BLE001 - best effort; shutdown() removes our records as well
                    log.debug("unregister on shutdown: %s", e)
            self.runtime.shutdown()
            for t in serving:
                try:
                    await asyncio.wait_for(t, 10.0)
                except (TimeoutError, asyncio.CancelledError):
                    t.cancel()
                except Exception as e:  # noqa: BLE001 - the endpoint's own error was logged above
                    log.debug("endpoint task: %s", e)
            await self.http.aclose()
            log.info("dynamo: unregistered")


def run_adapter(cfg: DynamoConfig) -> int:
    """Run until SIGTERM/SIGINT or until tito is gone; 0 on a clean stop."""
    if not dynamo_available():
        raise DynamoUnavailable("Dynamo support needs the extra: pip install 'tito[dynamo]'")
    import uvloop

    async def main() -> None:
        adapter = DynamoAdapter(cfg)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, adapter.stop)
        await adapter.run()

    uvloop.run(main())
    return 0


# --------------------------------------------------------------------------------------------------- beside `serve`


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def sidecar_urls(settings: Settings) -> tuple[str, str]:
    """(where the adapter reaches tito, what it advertises as admin_base_url) for ``tito serve`` settings."""
    import socket

    wildcard = settings.host in ("0.0.0.0", "::", "")
    local = f"http://{_url_host('127.0.0.1' if wildcard else settings.host)}:{settings.port}"
    advertised = settings.dynamo_admin_base_url or (
        f"http://{_url_host(socket.gethostname() if wildcard else settings.host)}:{settings.port}")
    return local, advertised.rstrip("/")


@contextmanager
def start_sidecar(settings: Settings) -> Iterator[subprocess.Popen[bytes]]:
    """``tito serve --dynamo-namespace NS``: run ``tito dynamo-register`` as a child process for the server's life.

    A separate process keeps Dynamo's runtime threads out of the process that forks vLLM's engine. It waits for
    the server to be ready, follows its drain and shutdown through ``/ready``, and is stopped (unregistering)
    when the server exits; if the server is killed outright it notices within ``gone_timeout`` and exits.
    """
    if not dynamo_available():
        raise SystemExit("tito: --dynamo-namespace needs the dynamo extra: pip install 'tito[dynamo]'")
    local, advertised = sidecar_urls(settings)
    cmd = [sys.executable, "-m", "app", "dynamo-register", "--tito-url", local, "--admin-base-url", advertised,
           "--namespace", str(settings.dynamo_namespace), "--component", settings.dynamo_component]
    env = dict(os.environ)
    env.setdefault("DYN_LOG", "warn")  # the runtime logs every request-plane call at info; tito logs what matters
    # Keys go through the environment, never argv (visible in ps).
    if settings.api_key:
        env["TITO_API_KEY"] = settings.api_key
    if settings.admin_api_key:
        env["TITO_ADMIN_API_KEY"] = settings.admin_api_key
    proc = subprocess.Popen(cmd, env=env)
    log.info("dynamo: adapter pid %d registering %s in namespace %r", proc.pid, advertised, settings.dynamo_namespace)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


# --------------------------------------------------------------------------------------------------- command line


def add_dynamo_command(sub: Any) -> None:
    """``tito dynamo-register``: the adapter as its own process, beside a running tito."""
    d = sub.add_parser(
        "dynamo-register", help="Register a running tito with Dynamo (serving and RL discovery) until stopped.",
        description="Register a running tito with Dynamo's runtime: a `generate` endpoint that forwards token "
        "requests to tito and an `rl` endpoint that tells Dynamo's frontend (GET /v1/rl/workers) where tito's admin "
        "API is. Unlisted while tito drains or its engine is dead; unregisters on SIGTERM/SIGINT. Needs the "
        "`dynamo` extra. Without etcd: DYN_DISCOVERY_BACKEND=file DYN_FILE_KV=<dir shared with the frontend>.")
    d.add_argument("--tito-url", default=os.environ.get("TITO_URL", "http://127.0.0.1:8000"),
                   help="Where this process reaches tito [env TITO_URL; default http://127.0.0.1:8000].")
    d.add_argument("--namespace", default=os.environ.get("DYN_NAMESPACE", "dynamo"),
                   help="Dynamo namespace (the frontend's DYN_NAMESPACE) [env DYN_NAMESPACE; default dynamo].")
    d.add_argument("--component", default="tito", help="Dynamo component name (default tito).")
    d.add_argument("--admin-base-url", default=None,
                   help="tito URL advertised to trainers as admin_base_url (default: --tito-url).")
    d.add_argument("--discovery-backend", default=None, choices=("etcd", "file", "kubernetes", "mem"),
                   help="Dynamo discovery backend [env DYN_DISCOVERY_BACKEND; default etcd].")
    d.add_argument("--request-plane", default=None, choices=("tcp", "nats"),
                   help="Dynamo request plane [env DYN_REQUEST_PLANE; default tcp].")
    d.add_argument("--world-size", type=int, default=None,
                   help="world_size to advertise (default: tito's tensor x pipeline x data parallel size).")
    d.add_argument("--poll-interval", type=float, default=1.0, help="Seconds between tito health polls.")
    d.add_argument("--startup-timeout", type=float, default=900.0, help="Seconds to wait for tito to be ready.")
    d.add_argument("--api-key", default=None, help="tito's data-plane key [env TITO_API_KEY].")
    d.add_argument("--admin-api-key", default=None, help="tito's admin key [env TITO_ADMIN_API_KEY].")
    d.set_defaults(func=cmd_dynamo_register)


def cmd_dynamo_register(ns: Any) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = DynamoConfig(
        tito_url=ns.tito_url, namespace=ns.namespace, component=ns.component, admin_base_url=ns.admin_base_url,
        discovery_backend=ns.discovery_backend, request_plane=ns.request_plane, world_size=ns.world_size,
        poll_interval=ns.poll_interval, startup_timeout=ns.startup_timeout,
        api_key=ns.api_key or os.environ.get("TITO_API_KEY"),
        admin_api_key=ns.admin_api_key or os.environ.get("TITO_ADMIN_API_KEY"))
    try:
        return run_adapter(cfg)
    except (DynamoUnavailable, TimeoutError) as e:
        print(f"tito dynamo-register: {e}", file=sys.stderr)
        return 2
