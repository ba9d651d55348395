"""Dynamo RL discovery: make a running tito findable by a Dynamo frontend (``GET /v1/rl/workers``).

Dynamo's frontend speaks its own request plane, never plain HTTP, so tito joins through the ``ai-dynamo-runtime``
bindings (optional extra ``dynamo``), as a small adapter process beside tito (``tito dynamo-register``, or started by
``tito serve --dynamo-namespace NS``). It serves two endpoints in ``<namespace>.<component>``:

- ``generate``: forwards token requests to tito's HTTP API. Dynamo's preprocessed shape (``token_ids``,
  ``sampling_options``, ``stop_conditions``, ``output_options``) is streamed as Dynamo chunks; a vLLM-shaped body
  (with ``sampling_params``) is posted as is and its JSON answer returned.
- ``rl``: answers ``{"method": "routes"}`` with ``{"status": "ok", "routes": [...], "admin_base_url": ...,
  "world_size": N}``, the contract the frontend's RL worker listing and Prime-RL's discovery read.

Health flows both ways: the adapter polls tito's ``/health`` and, while tito drains, shuts down or its engine is
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
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import orjson

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger("tito.dynamo")

# Dynamo's frontend lists live instances of this endpoint name (its DYN_RL_ENDPOINT default).
RL_ENDPOINT = "rl"
GENERATE_ENDPOINT = "generate"
GENERATE_PATH = "/inference/v1/generate"


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


# --------------------------------------------------------------------------------------------------- translation


def to_tito_body(request: dict[str, Any]) -> dict[str, Any]:
    """Dynamo's preprocessed token request → tito's ``GenerateRequest`` (streaming)."""
    so = request.get("sampling_options") or {}
    sc = request.get("stop_conditions") or {}
    oo = request.get("output_options") or {}
    sp: dict[str, Any] = {}
    for key in ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                "repetition_penalty"):
        if so.get(key) is not None:
            sp[key] = so[key]
    if sc.get("max_tokens") is not None:
        sp["max_tokens"] = sc["max_tokens"]
    if sc.get("min_tokens") is not None:
        sp["min_tokens"] = sc["min_tokens"]
    if sc.get("ignore_eos") is not None:
        sp["ignore_eos"] = bool(sc["ignore_eos"])
    stops = list(sc.get("stop_token_ids") or []) + list(sc.get("stop_token_ids_hidden") or [])
    if stops:
        sp["stop_token_ids"] = sorted(set(stops))
    if oo.get("logprobs") is not None:
        sp["logprobs"] = int(oo["logprobs"])
    body: dict[str, Any] = {"token_ids": list(request["token_ids"]), "sampling_params": sp, "stream": True,
                            "stream_options": {"include_usage": True}}
    if request.get("model"):
        body["model"] = request["model"]
    return body


def to_dynamo_chunk(choice: dict[str, Any]) -> dict[str, Any]:
    """One streamed tito choice → one Dynamo ``LLMEngineOutput`` chunk."""
    out: dict[str, Any] = {"token_ids": list(choice.get("token_ids") or []), "index": int(choice.get("index", 0))}
    if choice.get("finish_reason"):
        out["finish_reason"] = choice["finish_reason"]
    content = (choice.get("logprobs") or {}).get("content")
    if content:
        out["log_probs"] = [e["logprob"] for e in content]
        out["top_logprobs"] = [[{"token_id": t["token_id"], "logprob": t["logprob"], "rank": t.get("rank")}
                                for t in e.get("top_logprobs", [])] for e in content]
    return out


async def sse_events(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            return
        yield orjson.loads(payload)


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

    # ------------------------------------------------------------------ request-plane handlers

    async def generate(self, request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        if not isinstance(request, dict) or not isinstance(request.get("token_ids"), list):
            yield {"token_ids": [], "index": 0, "finish_reason": "error",
                   "error": "request needs token_ids (a list of ints)"}
            return
        if "sampling_params" in request:  # already vLLM/tito-shaped: pass through, answer tito's JSON
            body = dict(request, stream=False)
            r = await self.http.post(GENERATE_PATH, json=body)
            yield r.json() if r.headers.get("content-type", "").startswith("application/json") else {
                "error": {"message": r.text, "code": r.status_code}}
            return
        async with self.http.stream("POST", GENERATE_PATH, json=to_tito_body(request)) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")
                yield {"token_ids": [], "index": 0, "finish_reason": "error", "error": detail}
                return
            usage = None
            finals: list[dict[str, Any]] = []
            async for event in sse_events(r):
                if "error" in event:
                    yield {"token_ids": [], "index": 0, "finish_reason": "error", "error": event["error"]}
                    return
                if event.get("usage") and not event.get("choices"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    chunk = to_dynamo_chunk(choice)
                    if "finish_reason" in chunk:
                        finals.append(chunk)  # held back so the terminal chunk can carry the usage
                    else:
                        yield chunk
                if context is not None and getattr(context, "is_stopped", lambda: False)():
                    return
            for i, chunk in enumerate(finals):
                if usage and i == len(finals) - 1:
                    chunk["completion_usage"] = {k: usage[k] for k in ("prompt_tokens", "completion_tokens",
                                                                        "total_tokens") if k in usage}
                yield chunk

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

    async def run(self) -> None:
        try:
            from dynamo._core import DistributedRuntime, ModelInput, ModelType, WorkerType, register_model
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
        model = self.info["model"]
        # A card gives the frontend the model's name (the `model` of /v1/rl/workers); no OpenAI surface is claimed
        # (tito is tokens-only and the frontend would need a tokenizer to serve chat), and no assets are read.
        await register_model(ModelInput.Tokens, ModelType.Empty, gen_ep, model["path"], model["served_model_name"],
                             worker_type=WorkerType.Aggregated, skip_model_assets=True,
                             user_data={"http_base_url": cfg.advertised_url,
                                        "generate_url": cfg.advertised_url + GENERATE_PATH})
        canary = {"token_ids": [1], "stop_conditions": {"max_tokens": 1, "ignore_eos": True},
                  "sampling_options": {"temperature": 0.0}}
        serving = [asyncio.ensure_future(gen_ep.serve_endpoint(self.generate, health_check_payload=canary)),
                   asyncio.ensure_future(rl_ep.serve_endpoint(self.rl))]
        self.ready = False
        watcher = asyncio.ensure_future(self._watch())
        log.info("dynamo: %s registered in namespace %r (component %r, backend %s), admin_base_url=%s, "
                 "world_size=%d", model["served_model_name"], cfg.namespace, cfg.component, cfg.backend(),
                 cfg.advertised_url, self.world_size)
        try:
            done, _ = await asyncio.wait([watcher, *serving], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not watcher and t.exception() is not None:
                    log.error("dynamo endpoint stopped: %s", t.exception())
        finally:
            self.stop()
            watcher.cancel()
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
        "dynamo-register", help="Register a running tito with Dynamo (RL discovery) until stopped.",
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
