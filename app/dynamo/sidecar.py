"""``tito serve --dynamo-namespace NS``: Dynamo's own vLLM sidecar (``python -m dynamo.vllm.sidecar``, ai-dynamo 1.6.1)
as a child process of the server, for convenience; started by hand it works the same (docs/guides/dynamo.md).

The sidecar is Dynamo's worker for vLLM's native gRPC services: it connects to tito's ``vllm.Control`` /
``vllm.Inference`` on ``--grpc-port`` (waiting until they report SERVING), registers the model with Dynamo (serving,
KV-aware routing from the engine's KV events, cancellation), and with a system port (``--dynamo-system-port`` or
``DYN_SYSTEM_PORT``) serves engine-control routes and publishes tito's HTTP URL for RL trainers (``--enable-rl``:
``admin_base_url`` in the frontend's ``GET /v1/rl/workers``). A separate process keeps Dynamo's runtime threads out
of the process that forks vLLM's engine. app/dynamo/supervisor.py runs it: started once the server is ready,
stopped first when the replica drains or stops (it leaves discovery), restarted if it dies.

Discovery and transport settings (``DYN_DISCOVERY_BACKEND``, ``DYN_FILE_KV``, ...) reach it through the environment.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import sys

from app.core.settings import Settings

log = logging.getLogger("tito.dynamo")

# The sidecar reads DYN_SYSTEM_PORT as a signed 16-bit number: a higher port stops it at start.
MAX_SYSTEM_PORT = 32767
STOP_TIMEOUT_S = 30.0  # its graceful shutdown: leave discovery, let the requests it carries end


def dynamo_available() -> bool:
    """Is Dynamo's sidecar installed (``ai-dynamo`` + ``ai-dynamo-runtime``)? Looks without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec("dynamo._core") is not None and \
            importlib.util.find_spec("dynamo.vllm") is not None
    except ModuleNotFoundError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def admin_base_url(settings: Settings) -> str:
    """tito's HTTP URL as trainers should reach it: ``--dynamo-admin-base-url``, else ``http://<host>:<port>`` with
    this machine's hostname when ``--host`` is a wildcard. A bare origin: Prime-RL refuses a path prefix."""
    wildcard = settings.host in ("0.0.0.0", "::", "")
    host = socket.gethostname() if wildcard else settings.host
    return (settings.dynamo_admin_base_url or f"http://{_url_host(host)}:{settings.port}").rstrip("/")


def free_system_port() -> int:
    """A free port the sidecar accepts as DYN_SYSTEM_PORT: Dynamo reads it as a signed 16-bit number, and the kernel's
    own free ports (the ephemeral range) usually lie above 32767."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, MAX_SYSTEM_PORT + 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {MAX_SYSTEM_PORT + 1}")


def sidecar_command(settings: Settings, environ: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The sidecar's command line and environment for ``tito serve`` settings (SystemExit on a bad combination)."""
    env = dict(os.environ if environ is None else environ)
    if not settings.grpc_port:
        raise SystemExit("tito: --dynamo-namespace runs Dynamo's vLLM sidecar, which talks to tito over gRPC: "
                         "set --grpc-port too")
    wildcard = settings.host in ("0.0.0.0", "::", "")
    grpc_host = "127.0.0.1" if wildcard else settings.host  # pod-local: loopback when tito listens everywhere
    endpoint = f"{_url_host(grpc_host)}:{settings.grpc_port}"
    cmd = [sys.executable, "-m", "dynamo.vllm.sidecar", "--grpc-endpoint", endpoint, "--namespace",
           str(settings.dynamo_namespace), "--component", settings.dynamo_component, "--vllm-http-endpoint",
           admin_base_url(settings)]
    port = settings.dynamo_system_port
    if port is None and env.get("DYN_SYSTEM_PORT"):
        port = int(env["DYN_SYSTEM_PORT"])
    if port is not None:
        if not 0 <= port <= MAX_SYSTEM_PORT:
            raise SystemExit(f"tito: the sidecar's system port must be in [0, {MAX_SYSTEM_PORT}] (Dynamo reads "
                             f"DYN_SYSTEM_PORT as a 16-bit signed number), got {port}")
        env["DYN_SYSTEM_PORT"] = str(port)
        cmd.append("--enable-rl")  # RL discovery and engine-control routes live on the system port
    if settings.enable_lora:
        env.setdefault("DYN_LORA_ENABLED", "true")
    env.setdefault("DYN_LOG", "warn")  # the runtime logs every request-plane call at info
    return cmd, env
