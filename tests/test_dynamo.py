"""Dynamo RL discovery, end to end with a real Dynamo frontend (ai-dynamo 1.6.1) and no etcd/NATS/Kubernetes.

tito runs with ``--dynamo-namespace``; the frontend (``DYN_ENABLE_RL=1``) must list it at ``/v1/rl/workers`` with
tito's own URL as ``admin_base_url`` and its ``world_size``; a Prime-RL-style admin call through that URL works;
token requests reach tito through Dynamo's request plane; a drain takes it out of the list (and undrain puts it
back); shutting tito down unregisters it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.dynamo.adapter import dynamo_available
from app.tiny.model import make_tiny_model
from tests.conftest import start_tito
from tests.helpers import ServerProcess, engine_env, free_port

pytestmark = pytest.mark.skipif(not dynamo_available(), reason="the `dynamo` extra (ai-dynamo-runtime) is not "
                                "installed; `make test` installs it")

NS = "titotest"

# A Dynamo client calling tito's `generate` endpoint over Dynamo's request plane (what the frontend or a router does).
CLIENT = """
import asyncio, json, sys
import uvloop
from dynamo._core import DistributedRuntime

async def main():
    rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    client = await rt.endpoint(sys.argv[1]).client()
    await asyncio.wait_for(client.wait_for_instances(), 30)
    out = [item.data() async for item in await client.generate(json.loads(sys.argv[2]))]
    print("RESULT " + json.dumps(out), flush=True)
    rt.shutdown()

uvloop.run(main())
"""


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


@pytest.fixture(scope="module")
def dyn_env(tmp_path_factory) -> dict[str, str]:
    kv = tmp_path_factory.mktemp("dynamo_kv")
    return {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(kv), "DYN_NAMESPACE": NS, "DYN_LOG": "warn"}


@pytest.fixture(scope="module")
def frontend(dyn_env, tmp_path_factory) -> Iterator[tuple[ServerProcess, str]]:
    http_port = free_port()
    rl_port = free_port()
    while rl_port == http_port:  # two calls may hand out the same just-released port
        rl_port = free_port()
    env = engine_env({**dyn_env, "DYN_ENABLE_RL": "1", "DYN_RL_PORT": str(rl_port)})
    log = tmp_path_factory.mktemp("logs") / "dynamo-frontend.log"
    cmd = [sys.executable, "-m", "dynamo.frontend", "--http-port", str(http_port), "--discovery-backend", "file"]
    proc = ServerProcess(cmd, http_port, log, env=env, health_path="/live").start(timeout=120)
    yield proc, f"http://127.0.0.1:{rl_port}"
    proc.kill()


@pytest.fixture(scope="module")
def dyn_tito(tmp_path_factory, dyn_env, frontend) -> Iterator[ServerProcess]:
    # A model dir without tokenizer files: registered for discovery only (ModelType.Empty), served as before.
    bare = make_tiny_model(tmp_path_factory.mktemp("bare") / "tiny-qwen3", tokenizer=False)
    server = start_tito(tmp_path_factory, bare, "--dynamo-namespace", NS, env=dyn_env, name="tito-dynamo")
    yield server
    server.kill()


def workers(rl_url: str) -> list[dict[str, Any]]:
    r = httpx.get(rl_url + "/v1/rl/workers", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["protocol_version"] == 1
    return [w for w in body["workers"] if w.get("component") == "tito"]


def instance_files(dyn_env: dict[str, str]) -> list[str]:
    d = Path(dyn_env["DYN_FILE_KV"]) / "v1" / "instances"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_frontend_lists_tito_and_admin_calls_work(frontend, dyn_tito, dyn_env):
    _, rl_url = frontend
    listed = wait_for(lambda: workers(rl_url), 90, "tito in /v1/rl/workers")
    assert len(listed) == 1
    w = listed[0]
    assert w["namespace"] == NS and w["endpoint"] == "rl"
    assert w["admin_base_url"] == dyn_tito.url
    info = httpx.get(dyn_tito.url + "/server_info", timeout=30).json()
    assert w["world_size"] == info["parallelism"]["world_size"] == 1
    assert w["model"] == info["model"]["served_model_name"]
    assert w.get("error") is None
    assert {"/pause", "/resume", "/update_weights", "/load_lora_adapter"} <= set(w["routes"])
    assert info["model"]["has_tokenizer"] is False
    card = json.loads(next((Path(dyn_env["DYN_FILE_KV"]) / "v1" / "mdc").iterdir()).read_text())["card_json"]
    assert "Chat" not in card["model_type"] and "Completions" not in card["model_type"]  # ModelType.Empty

    # Prime-RL's admin client talks to admin_base_url directly.
    with httpx.Client(base_url=w["admin_base_url"], timeout=60) as admin:
        try:
            assert admin.post("/pause", params={"mode": "keep"}).status_code == 200
            assert admin.get("/is_paused").json() == {"is_paused": True}
            assert admin.post("/resume").status_code == 200
            assert admin.get("/is_paused").json() == {"is_paused": False}
        finally:
            admin.post("/resume")


def test_generate_through_dynamos_request_plane(frontend, dyn_tito, dyn_env):
    _, rl_url = frontend
    wait_for(lambda: workers(rl_url), 90, "tito in /v1/rl/workers")
    prompt = [5, 6, 7, 8]
    req = {"token_ids": prompt, "stop_conditions": {"max_tokens": 5, "ignore_eos": True},
           "sampling_options": {"temperature": 0.0}, "output_options": {"logprobs": 1}}
    env = engine_env(dyn_env)
    run = subprocess.run([sys.executable, "-c", CLIENT, f"{NS}.tito.generate", json.dumps(req)], env=env,
                         capture_output=True, text=True, timeout=90)
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, run.stdout[-2000:] + run.stderr[-2000:]
    chunks = json.loads(lines[0][len("RESULT "):])
    tokens = [t for ch in chunks for t in ch["token_ids"]]
    direct = httpx.post(dyn_tito.url + "/inference/v1/generate", timeout=60,
                        json={"token_ids": prompt, "sampling_params": {"max_tokens": 5, "temperature": 0,
                                                                       "ignore_eos": True}}).json()
    assert tokens == direct["choices"][0]["token_ids"]
    assert chunks[-1]["finish_reason"] == "length"
    usage = chunks[-1]["completion_usage"]
    assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == \
        {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    assert usage.get("prompt_tokens_details", {}).get("cached_tokens", 0) in range(0, 5)
    assert sum(len(ch.get("log_probs", [])) for ch in chunks) == 5


def test_drain_unlists_and_shutdown_unregisters(frontend, dyn_tito, dyn_env):
    _, rl_url = frontend
    wait_for(lambda: workers(rl_url), 90, "tito in /v1/rl/workers")
    with httpx.Client(base_url=dyn_tito.url, timeout=60) as c:
        try:
            assert c.post("/drain", json={"timeout": 1}).status_code == 200
            wait_for(lambda: workers(rl_url) == [], 60, "tito to leave /v1/rl/workers while draining")
            # The adapter takes its two instances out one after the other: the listing can change first.
            wait_for(lambda: instance_files(dyn_env) == [], 30, "both instances unregistered while draining")
        finally:
            c.delete("/drain")
        back = wait_for(lambda: workers(rl_url), 60, "tito back in /v1/rl/workers after undrain")
        assert back[0]["admin_base_url"] == dyn_tito.url
    files = wait_for(lambda: len(instance_files(dyn_env)) == 2 and instance_files(dyn_env), 30,
                     "both instances registered again")  # generate and rl
    assert len(files) == 2
    dyn_tito.stop()
    wait_for(lambda: workers(rl_url) == [], 60, "tito to leave /v1/rl/workers after shutdown")
    wait_for(lambda: instance_files(dyn_env) == [], 30, "both instances unregistered after shutdown")
    assert "dynamo: unregistered" in dyn_tito.log_text()
