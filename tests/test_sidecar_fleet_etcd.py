"""The production shape of a fleet: etcd as Dynamo's discovery backend (Debian's ``etcd-server``, started and stopped
here) and a replica on an address of its own (a network namespace joined by a veth pair, as a separate machine
would be), with the frontend in the root namespace. Commands and traps: docs/guides/fleet.md.

One replica, one engine start: it serves through the frontend with tito's own greedy tokens, RL discovery names its
namespace address, drain takes its keys out of etcd before the drain answers (undrain puts them back), and when its
EngineCore dies the replica leaves etcd before it exits.
Skipped, saying why, when etcd is not installed or network namespaces are not permitted (not root)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import ServerProcess, engine_env, free_port, tito_cmd
from tests.sidecar import MODEL, dynamo_available, models_listed, rl_workers, start_frontend, system_port, wait_for
from tests.streaming import GEN

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not dynamo_available(), reason="Dynamo (ai-dynamo + ai-dynamo-runtime) is not "
                                 "installed; `make test` installs it")]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


class Netns:
    """A network namespace ``name`` joined to the root one by a veth pair: host side ``<net>.1``, inside ``<net>.2``,
    no default route inside (as the trap in the guide says)."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.name = f"tfl{tag}"
        self.host_if, self.ns_if = f"tfh{tag}", f"tfn{tag}"
        net = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
        self.host, self.addr = f"{net}.1", f"{net}.2"

    def create(self) -> str | None:
        """None when it worked, else why not."""
        steps = [("ip", "netns", "add", self.name),
                 ("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if),
                 ("ip", "link", "set", self.ns_if, "netns", self.name),
                 ("ip", "addr", "add", f"{self.host}/24", "dev", self.host_if),
                 ("ip", "link", "set", self.host_if, "up"),
                 ("ip", "netns", "exec", self.name, "ip", "addr", "add", f"{self.addr}/24", "dev", self.ns_if),
                 ("ip", "netns", "exec", self.name, "ip", "link", "set", self.ns_if, "up"),
                 ("ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up")]
        for step in steps:
            r = _run(*step)
            if r.returncode != 0:
                return f"`{' '.join(step)}` failed: {r.stderr.strip()}"
        return None

    def delete(self) -> None:
        _run("ip", "netns", "del", self.name)  # removes the veth pair too
        _run("ip", "link", "del", self.host_if)


@pytest.fixture(scope="module")
def netns() -> Iterator[Netns]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    ns = Netns()
    why = ns.create()
    if why is not None:
        ns.delete()
        pytest.skip(f"network namespaces are not permitted here: {why}")
    yield ns
    ns.delete()


@pytest.fixture(scope="module")
def etcd(netns: Netns, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        pytest.skip("etcd is not installed (Debian: apt-get install -y etcd-server etcd-client; CI's .ci/run does)")
    client, peer = free_port(), free_port()
    url = f"http://{netns.host}:{client}"
    data = tmp_path_factory.mktemp("etcd")
    log = open(data.parent / "etcd.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(["etcd", "--name", "fleet", "--data-dir", str(data / "d"),
                             "--listen-client-urls", f"http://127.0.0.1:{client},{url}", "--advertise-client-urls", url,
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"fleet=http://127.0.0.1:{peer}"],
                            stdout=log, stderr=subprocess.STDOUT, process_group=0)
    try:
        wait_for(lambda: _status(url + "/health") == 200, 30, "etcd to answer")
        yield url
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _keys(etcd_url: str, prefix: str) -> list[str]:
    r = _run("etcdctl", "--endpoints", etcd_url, "get", "--prefix", prefix, "--keys-only")
    assert r.returncode == 0, r.stderr
    return [k for k in r.stdout.splitlines() if k.strip()]


@pytest.fixture(scope="module")
def fleet(netns: Netns, etcd: str, tiny_model: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    ns = f"tfleet{os.getpid()}{random.randrange(1000)}"  # concurrent runs share nothing in etcd
    common = {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": etcd, "DYN_NAMESPACE": ns, "DYN_LOG": "warn"}
    logs = tmp_path_factory.mktemp("etcd-fleet-logs")
    fe, rl_url = start_frontend({**common, "DYN_TCP_RESPONSE_STREAM_HOST": netns.host}, logs / "frontend.log",
                                extra_env={"DYN_LORA_ENABLED": "true"})
    port, sys_port = free_port(), system_port()
    cmd = ["ip", "netns", "exec", netns.name, *tito_cmd(tiny_model, port, "--host", netns.addr,
           "--served-model-name", MODEL, "--grpc-port", str(free_port()), "--kv-events-port", "0", "--block-size",
           "32", "--num-kv-blocks", "128", "--dynamo-namespace", ns, "--dynamo-system-port", str(sys_port),
           "--state-dir", str(tmp_path_factory.mktemp("etcd-replica-state")), "--engine-death-exit-delay", "10")]
    env = engine_env({**common, "VLLM_HOST_IP": "127.0.0.1", "DYN_TCP_RPC_HOST": netns.addr,
                      "DYN_EVENT_PLANE_HOST": netns.addr, "DYN_SYSTEM_HOST": netns.addr})
    replica = ServerProcess(cmd, port, logs / "replica.log", env=env)
    replica.url = f"http://{netns.addr}:{port}"
    try:
        replica.start(timeout=float(os.environ.get("TITO_TEST_START_TIMEOUT", "240")))
        wait_for(lambda: MODEL in models_listed(fe), 120, "the model in the frontend's /v1/models")
        yield {"fe": fe, "rl": rl_url, "replica": replica, "ns": ns, "etcd": etcd,
               "system_url": f"http://{netns.addr}:{sys_port}"}
    finally:
        replica.kill()
        fe.kill()


def test_a_replica_on_its_own_address_serves_through_etcd_discovery_and_drain_leaves_etcd_first(
        fleet: dict[str, Any], netns: Netns) -> None:
    fe, replica, etcd, ns = fleet["fe"], fleet["replica"], fleet["etcd"], fleet["ns"]
    prompt = [17, 250, 33, 401, 9, 77]
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 12, "temperature": 0, "ignore_eos": True}}
    direct = httpx.post(replica.url + GEN, json=body, timeout=120)
    assert direct.status_code == 200, direct.text
    via = httpx.post(fe.url + GEN, json={"model": MODEL, **body}, timeout=120)
    assert via.status_code == 200, via.text
    assert via.json()["choices"][0]["token_ids"] == direct.json()["choices"][0]["token_ids"]
    [w] = rl_workers(fleet["rl"])
    assert w["admin_base_url"].rstrip("/") == replica.url and w["system_url"] == fleet["system_url"]
    keys = _keys(etcd, f"v1/instances/{ns}/")
    assert {k.split("/")[4] for k in keys} >= {"generate", "rl"}, keys
    records = _run("etcdctl", "--endpoints", etcd, "get", "--prefix", f"v1/instances/{ns}/backend/generate",
                   "--print-value-only").stdout
    assert f'"{netns.addr}:' in records  # the request plane advertises the namespace's address

    t0 = time.monotonic()
    r = httpx.post(replica.url + "/drain", json={"timeout": 30}, timeout=90)
    assert r.status_code == 200 and r.json()["status"] == "drained", r.text
    drained_s = time.monotonic() - t0
    assert _keys(etcd, f"v1/instances/{ns}/") == []  # out of etcd by the time the drain answers
    wait_for(lambda: MODEL not in models_listed(fe), 30, "the model gone from the frontend")
    t1 = time.monotonic()
    assert httpx.post(replica.url + "/undrain", timeout=30).status_code == 200
    wait_for(lambda: MODEL in models_listed(fe), 120, "the model back at the frontend")
    via = httpx.post(fe.url + GEN, json={"model": MODEL, **body}, timeout=120)
    assert via.status_code == 200 and via.json()["choices"][0]["token_ids"] == direct.json()["choices"][0]["token_ids"]
    print(f"FLEET etcd + netns: out of etcd {drained_s:.1f}s after POST /drain; back and serving "
          f"{time.monotonic() - t1:.1f}s after /undrain")

    # The replica's last act: its EngineCore dies. tito stops the sidecar (out of etcd) before it exits.
    import psutil

    assert replica.proc is not None
    [core] = [p for p in psutil.Process(replica.proc.pid).children(recursive=True) if "EngineCore" in p.name()]
    t2 = time.monotonic()
    core.kill()
    wait_for(lambda: _keys(etcd, f"v1/instances/{ns}/") == [], 60, "the replica's keys gone from etcd", 0.1)
    gone_s = time.monotonic() - t2
    assert replica.proc.poll() is None  # still up (--engine-death-exit-delay): it left discovery first
    assert replica.proc.wait(60) == 1
    assert "leaving the fleet" in replica.log_text()
    print(f"FLEET etcd + netns: EngineCore killed; out of etcd after {gone_s:.1f}s, tito exited "
          f"{time.monotonic() - t2:.1f}s after the kill")
