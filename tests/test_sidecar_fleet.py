"""A Dynamo fleet of two tito replicas through the operations an RL run puts it through, each under load from
closed-loop clients that count every answer and check it (greedy: the current step's answer, so an answer
from a stale policy counts as a failure too).

The fleet: the shared replicas ``sidecar_a`` (its sidecar started by hand, as test_sidecar_serve.py does) and
``sidecar_b`` (``tito serve --dynamo-namespace``: tito supervises its own sidecar), Dynamo's frontend in
``--router-mode kv`` with request migration (``--migration-limit 3``) and LoRA-aware routing (``DYN_LORA_ENABLED``),
file discovery in this run's directory. Operations: b drains and undrains (leaves discovery before it refuses
anything), b's sidecar is SIGKILLed (restarted, rejoins), an adapter is loaded through b's sidecar only (served by
the fleet), and a Prime-style run: step 1 a weight directory, step 2 a staged delta, then b's process group is
SIGKILLed under load and restarted with the same command line (it comes back at step 2, restored from its weight
record, before it rejoins), then step 3. One restart in all. Every figure of docs/guides/fleet.md's table is printed
here (``FLEET`` lines). Named to run just before test_sidecar_grpc.py and test_sidecar_serve.py, which use the same
two replicas (no extra engine start beside the one restart; test_sidecar_serve.py shuts b down at its end).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file

from app.tiny.model import tiny_state_dict
from tests import prime_stage_client as prime
from tests.delta_encoder import perturb, write_delta
from tests.helpers import ServerProcess, metric_value, restore_server
from tests.sidecar import (
    MODEL,
    child_system_url,
    dynamo_available,
    dynamo_env,
    dynamo_kv_dir,
    model_dir,
    models_listed,
    rl_workers,
    start_frontend,
    start_sidecar,
    wait_for,
)
from tests.streaming import GEN

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not dynamo_available(), reason="Dynamo (ai-dynamo + ai-dynamo-runtime) is not "
                                 "installed; `make test` installs it")]

N_PROMPTS = 12
MAX_TOKENS = 16
CLIENTS = 3


def _prompts() -> list[list[int]]:
    rng = random.Random(35)
    return [[rng.randrange(5, 500) for _ in range(rng.randrange(4, 40))] for _ in range(N_PROMPTS)]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def replicas(sidecar_a: ServerProcess, sidecar_b: ServerProcess) -> Iterator[list[ServerProcess]]:
    yield [sidecar_a, sidecar_b]
    for r in (sidecar_a, sidecar_b):  # the base weights (and a base record) for the modules after this one
        restore_server(r.url)


@pytest.fixture(scope="module")
def dyn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return dynamo_env(dynamo_kv_dir(tmp_path_factory.getbasetemp()))  # the directory b's own sidecar uses


@pytest.fixture(scope="module")
def fleet(replicas: list[ServerProcess], dyn: dict[str, str],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """a's sidecar by hand, b's own, the frontend with migration and LoRA-aware routing; both replicas listed."""
    a, b = replicas
    logs = tmp_path_factory.mktemp("fleet-logs")
    side_a = start_sidecar(dyn, a, logs / "sidecar-a.log")
    fe = None
    try:
        wait_for(lambda: _status(child_system_url(b) + "/health") == 200, 180, "b's own sidecar to be ready")
        fe, rl_url = start_frontend(dyn, logs / "frontend.log", extra_env={"DYN_LORA_ENABLED": "true"})
        wait_for(lambda: MODEL in models_listed(fe), 120, "the model in the frontend's /v1/models")
        wait_for(lambda: len(rl_workers(rl_url)) == 2, 120, "both replicas in /v1/rl/workers")
        yield {"fe": fe, "rl": rl_url, "side_a": side_a}
    finally:
        if fe is not None:
            fe.kill()
        side_a.kill()


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _direct(r: ServerProcess, prompts: list[list[int]] = PROMPTS, model: str | None = None) -> list[list[int]]:
    out = []
    with httpx.Client(base_url=r.url, timeout=120) as c:
        for p in prompts:
            resp = c.post(GEN, json={"token_ids": p, **({"model": model} if model else {}), "sampling_params": {
                "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}})
            assert resp.status_code == 200, resp.text
            out.append(list(resp.json()["choices"][0]["token_ids"]))
    return out


def _served(r: ServerProcess) -> float:
    """Requests the replica's engine finished."""
    try:
        return metric_value(httpx.get(r.url + "/metrics", timeout=30).text, "vllm:request_success_total") or 0.0
    except httpx.HTTPError:
        return 0.0


def _refused(r: ServerProcess) -> float:
    """gRPC generate calls the replica refused (UNAVAILABLE: draining, shutting down)."""
    text = httpx.get(r.url + "/metrics", timeout=30).text
    return sum(metric_value(text, "tito_grpc_requests_total", {"method": m, "code": "UNAVAILABLE"}) or 0.0
               for m in ("Generate", "GenerateStream"))


def _info(r: ServerProcess) -> dict[str, Any]:
    return dict(httpx.get(r.url + "/server_info", timeout=30).json())


def _instances(rl_url: str) -> dict[str, int]:
    """admin URL -> instance id of every live replica in RL discovery (a killed sidecar's record stays until its
    lease lapses; the frontend's probe of it fails, and it is listed with an ``error`` and no admin URL)."""
    return {w["admin_base_url"].rstrip("/"): w["instance_id"] for w in rl_workers(rl_url) if w.get("admin_base_url")}


def _texts(fe: ServerProcess, model: str = MODEL) -> list[str]:
    """The frontend's greedy completion text of every prompt, asked while every replica holding ``model`` is known to
    be on the step's weights (their direct greedy tokens compared first): the answers a client must get during the
    operation that follows. (Dynamo's text is the replica's detokenized stream, not the tokenizer's decode of the
    whole output, which differs for some byte-token prompts: the reference is taken through the same path.)"""
    out = []
    with httpx.Client(timeout=120) as c:
        for p in PROMPTS:
            r = c.post(fe.url + "/v1/completions", json={"model": model, "prompt": p, "max_tokens": MAX_TOKENS,
                                                         "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            out.append(str(r.json()["choices"][0]["text"]))
    return out


def _same(got: str, want: str) -> bool:
    # Random weights sample byte tokens: a character split across the incremental detokenizer's steps may come out
    # as U+FFFD, and one split across a migration (re-sent as prompt + tokens so far) is lost, as vLLM's own
    # detokenizer loses it. Another policy's answer differs in far more than one character.
    got, want = got.replace("\ufffd", ""), want.replace("\ufffd", "")
    return got == want or (len(want) == len(got) + 1 and any(want[:i] + want[i + 1:] == got
                                                              for i in range(len(want))))


class Load:
    """``CLIENTS`` closed-loop clients through the frontend's ``/v1/completions`` (token prompts, greedy), over
    ``PROMPTS``: every answer is counted, and one whose text differs from ``expected`` (the current step's greedy
    answer) is stale. (Completions, not Dynamo's ``/inference/v1/generate``: in 1.6.1 that unary route does not
    migrate: "Migration limit exhausted" at the first attempt, whatever ``--migration-limit`` says.)"""

    def __init__(self, fe: ServerProcess, expected: list[str], model: str = MODEL) -> None:
        self.fe, self.expected, self.model = fe, expected, model
        self.sent = self.ok = 0
        self.failed: list[tuple[int, str]] = []
        self.stale: list[tuple[int, str, str]] = []
        self.garbled: list[tuple[int, str, str]] = []  # the right answer, after text that should not be there
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=120) as c:
            while not self._stop.is_set():
                i = rng.randrange(len(PROMPTS))
                with self._lock:
                    self.sent += 1
                try:
                    r = c.post(self.fe.url + "/v1/completions", json={
                        "model": self.model, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                        "ignore_eos": True})
                except httpx.HTTPError as e:
                    with self._lock:
                        self.failed.append((0, repr(e)))
                    continue
                with self._lock:
                    if r.status_code != 200:
                        self.failed.append((r.status_code, r.text[:300]))
                    elif not _same(got := r.json()["choices"][0]["text"], self.expected[i]):
                        # Seen once in ~1,200 answers, on a request migrated after 11 tokens: the whole right text,
                        # after the first attempt's partial text (reported, not hidden: see the FLEET line).
                        garbled = got.replace("\ufffd", "").endswith(self.expected[i].replace("\ufffd", ""))
                        (self.garbled if garbled else self.stale).append((i, got, self.expected[i]))
                    else:
                        self.ok += 1

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(150)

    def more(self, n: int, what: str, timeout: float = 120) -> None:
        start = self.ok
        wait_for(lambda: self.ok >= start + n, timeout, what)

    def check(self, what: str, t_recover: float | None = None) -> None:
        print(f"FLEET {what}: sent {self.sent}, answered {self.ok}, failed {len(self.failed)}, stale "
              f"{len(self.stale)}, garbled after migration {len(self.garbled)}"
              + (f", recovered in {t_recover:.1f}s" if t_recover is not None else ""))
        for g in self.garbled:
            print(f"FLEET garbled answer (prompt {g[0]}): got {g[1]!r}, the step's answer {g[2]!r}")
        assert self.failed == [], self.failed[:5]
        assert self.stale == [], self.stale[:5]


# ------------------------------------------------------------------------------------------------ drain


def test_drain_leaves_discovery_before_refusing_and_undrain_rejoins(fleet: dict[str, Any],
                                                                     replicas: list[ServerProcess]) -> None:
    """b drains under load: its sidecar stops first (b leaves discovery while it still admits), in-flight requests
    finish, then b refuses; the frontend never routes a request to b that b refuses (its UNAVAILABLE count stays),
    so no request depends on migration. Undrain starts a new sidecar: b is back in discovery and serves."""
    a, b = replicas
    base = _direct(a)
    assert _direct(b) == base
    fe, rl_url = fleet["fe"], fleet["rl"]
    with Load(fe, _texts(fe)) as load:
        load.more(10, "traffic through the frontend")
        refused = _refused(b)
        t0 = time.monotonic()
        r = httpx.post(b.url + "/drain", json={"timeout": 30}, timeout=90)
        assert r.status_code == 200 and r.json()["status"] == "drained", r.text
        left = r.json()["left_fleet_s"]
        assert left is not None and left > 0
        assert b.url not in _instances(rl_url)  # gone from discovery by the time the drain answers
        info = _info(b)
        assert info["dynamo"]["sidecar"] == "stopped" and info["dynamo"]["reason"] == "drain"
        assert info["state"]["not_ready_reason"] == "draining"
        served = _served(b)
        load.more(15, "traffic served by a while b is drained")
        assert _served(b) == served  # nothing reached b
        assert _refused(b) == refused  # and b refused nothing: no request needed a retry
        drained_s = time.monotonic() - t0
        t1 = time.monotonic()
        assert httpx.post(b.url + "/undrain", timeout=30).status_code == 200
        wait_for(lambda: b.url in _instances(rl_url), 120, "b back in discovery")
        wait_for(lambda: _served(b) >= served + 3, 120, "b to serve again", 0.5)
        rejoin_s = time.monotonic() - t1
        assert _info(b)["dynamo"]["sidecar"] == "running"
    print(f"FLEET drain: sidecar out of discovery {left:.1f}s after POST /drain; drained {drained_s:.1f}s; "
          f"rejoined and serving {rejoin_s:.1f}s after /undrain")
    load.check("drain + undrain of b", rejoin_s)
    assert "dynamo: out of the fleet (drain)" in b.log_text()


# ------------------------------------------------------------------------------------------------ adapters


def test_an_adapter_loaded_through_one_sidecar_is_served_by_the_fleet(
        fleet: dict[str, Any], replicas: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> None:
    """LoRA-aware routing (``DYN_LORA_ENABLED=true`` on the frontend, ``--router-mode kv``): an adapter loaded through
    b's sidecar only is listed by the frontend, and every request for it goes to b: no failure, b's own tokens."""
    from tests.test_lora import make_weights, write_adapter

    a, b = replicas
    fe = fleet["fe"]
    base_sd = load_file(str(model_dir(a) / "model.safetensors"))
    root = tmp_path_factory.mktemp("fleet-lora")
    path = write_adapter(root / "ad", make_weights(base_sd, 3))
    side_b = child_system_url(b)
    r = httpx.post(side_b + "/engine/update/load_lora", json={"lora_name": "ad", "source": {"uri": f"file://{path}"}},
                   timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    try:
        t0 = time.monotonic()
        wait_for(lambda: "ad" in models_listed(fe), 60, "the adapter in the frontend's /v1/models")
        listed_s = time.monotonic() - t0
        want = _direct(b, model="ad")
        assert want != _direct(b)  # the adapter changes the answers
        assert "ad" not in {m["id"] for m in httpx.get(a.url + "/v1/models").json()["data"]}
        with Load(fe, _texts(fe, "ad"), model="ad") as load:
            load.more(30, "adapter requests through the frontend")
        load.check(f"adapter on b only (listed {listed_s:.1f}s after the load)")
        # An adapter loaded through tito's own HTTP route (as Prime-RL and TRL do) is not announced: Dynamo 1.6.1's
        # sidecar registers the adapters loaded through its own route only. (b holds two adapters at most: "ad" goes.)
        r = httpx.post(side_b + "/engine/update/unload_lora", json={"lora_name": "ad"}, timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "success", r.text
        adapter2 = write_adapter(root / "ad2", make_weights(base_sd, 4))
        r = httpx.post(b.url + "/v1/load_lora_adapter", json={"lora_name": "ad2", "lora_path": str(adapter2)},
                       timeout=120)
        assert r.status_code == 200, r.text
        # A later load through the sidecar: once the frontend lists it, it has seen everything announced before.
        adapter3 = write_adapter(root / "ad3", make_weights(base_sd, 5))
        r = httpx.post(side_b + "/engine/update/load_lora", json={"lora_name": "ad3", "source": {
            "uri": f"file://{adapter3}"}}, timeout=120)
        assert r.status_code == 200 and r.json()["status"] == "success", r.text
        wait_for(lambda: "ad3" in models_listed(fe), 60, "the second sidecar-loaded adapter at the frontend")
        assert "ad2" not in models_listed(fe)
        assert "ad2" in {m["id"] for m in httpx.get(b.url + "/v1/models").json()["data"]}
        r = httpx.post(fe.url + GEN, json={"model": "ad2", "token_ids": PROMPTS[0], "sampling_params": {
            "max_tokens": 4}}, timeout=60)
        assert r.status_code == 404, r.text
    finally:
        for name in ("ad", "ad3"):
            httpx.post(side_b + "/engine/update/unload_lora", json={"lora_name": name}, timeout=60)
        httpx.post(b.url + "/v1/unload_lora_adapter", json={"lora_name": "ad2"}, timeout=60)
    wait_for(lambda: not {"ad", "ad3"} & models_listed(fe), 60, "the adapters gone from the frontend")


# ------------------------------------------------------------------------------------------------ sidecar death


def test_a_killed_sidecar_is_restarted_and_the_replica_rejoins(fleet: dict[str, Any],
                                                               replicas: list[ServerProcess]) -> None:
    a, b = replicas
    fe, rl_url = fleet["fe"], fleet["rl"]
    before = _instances(rl_url)
    info = _info(b)["dynamo"]
    assert info["sidecar"] == "running" and info["pid"]
    restarts = info["restarts"]
    assert _direct(a) == _direct(b)
    with Load(fe, _texts(fe)) as load:
        load.more(10, "traffic through the frontend")
        t0 = time.monotonic()
        os.kill(info["pid"], signal.SIGKILL)
        wait_for(lambda: _info(b)["dynamo"]["restarts"] == restarts + 1, 30, "the supervisor to notice")
        wait_for(lambda: _info(b)["dynamo"]["sidecar"] == "running", 60, "a new sidecar")
        wait_for(lambda: _instances(rl_url).get(b.url) not in (None, before[b.url]), 120,
                 "b back in discovery under a new instance")
        served = _served(b)
        wait_for(lambda: _served(b) >= served + 3, 120, "b to serve again", 0.5)
        recover_s = time.monotonic() - t0
        load.more(5, "more traffic")
    new = _info(b)["dynamo"]
    assert new["pid"] != info["pid"] and new["last_exit"]["code"] == -signal.SIGKILL
    assert "restarting it in" in b.log_text()
    load.check("SIGKILL of b's sidecar", recover_s)


# ------------------------------------------------------------------------------------------------ Prime-style run


def _reference(sd: dict[str, Any], root: Path) -> list[list[int]]:
    from tests.test_weights import reference_greedy

    return list(reference_greedy(sd, root, PROMPTS[:3], MAX_TOKENS))


def test_prime_style_run_through_the_frontend(
        fleet: dict[str, Any], replicas: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Step 1: a weight directory (Prime-RL's disk update, pause/update/resume) on both. Step 2: a delta staged and
    committed (Prime-RL's stage/commit) on both; b's record holds it. Step 3: a directory again. Every answer through
    the frontend is the step's greedy answer (transformers on the step's weights for three prompts, the other replica
    for all). A replica SIGKILLed and restarted between steps: the next test, under Prime-RL's own orchestrator (the
    restore of a record with a delta: tests/test_weight_record.py)."""
    from tests.test_weights import write_step

    a, b = replicas
    fe, rl_url = fleet["fe"], fleet["rl"]
    root = tmp_path_factory.mktemp("fleet-steps")
    wait_for(lambda: len(rl_workers(rl_url)) == 2, 60, "only the two live replicas in discovery")
    admins = sorted(_instances(rl_url))
    assert admins == sorted(r.url for r in replicas)  # the trainer knows the replicas through RL discovery only

    sd1 = tiny_state_dict(101)
    write_step(root / "step_1", sd1)
    for url in admins:
        with httpx.Client(base_url=url, timeout=300) as c:
            assert c.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
            try:
                r = c.post("/update_weights", json={"weight_dir": str(root / "step_1")})
                assert r.status_code == 200 and r.json()["weight_version"] == "step_1", r.text
            finally:
                assert c.post("/resume").status_code == 200
    assert _direct(a)[:3] == _reference(sd1, root / "ref-1")

    sd2 = perturb(sd1, 0.05, 2)
    write_delta(root / "step_2" / "delta.stream", sd1, sd2)

    async def stage_commit() -> None:
        for url in admins:
            async with httpx.AsyncClient(base_url=url, timeout=300) as c:
                await prime.stage(c, root / "step_2", "step_2", "step_1", "path")
                r = await prime.commit(c, "step_2")
                assert r.status_code == 200 and r.json()["active_version"] == "step_2", r.text

    asyncio.run(stage_commit())
    want2 = _direct(a)
    assert want2[:3] == _reference(sd2, root / "ref-2") and _direct(b) == want2
    rec = _info(b)["state"]["weight_record"]["record"]
    assert rec["weight_version"] == "step_2" and len(rec["deltas"]) == 1
    assert rec["weights"]["dir"] == str((root / "step_1").resolve())

    with Load(fe, _texts(fe)) as load:
        load.more(20, "step-2 traffic through the frontend")
    load.check("step 2 (a staged delta) on both replicas")

    sd3 = tiny_state_dict(303)
    write_step(root / "step_3", sd3)
    for url in admins:
        with httpx.Client(base_url=url, timeout=300) as c:
            r = c.post("/update_weights", json={"weight_dir": str(root / "step_3")})
            assert r.status_code == 200 and r.json()["weight_version"] == "step_3", r.text
    want3 = _direct(a)
    assert want3[:3] == _reference(sd3, root / "ref-3") and _direct(b) == want3
    with Load(fe, _texts(fe)) as load:
        load.more(20, "step-3 traffic through the frontend")
    load.check("step 3 (a weight directory)")
    r = httpx.post(fe.url + GEN, json={"model": MODEL, "token_ids": PROMPTS[0], "sampling_params": {
        "max_tokens": 4, "temperature": 0}}, timeout=60)
    assert r.status_code == 200


def test_prime_rl_orchestrator_with_a_replica_sigkilled_between_steps(
        fleet: dict[str, Any], replicas: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Prime-RL's own processes, unchanged, from its source snapshot: its launcher writes the configs, its env-server
    and orchestrator run them (scripts/prime_run/run.py); tito's stand-in trainer takes the trainer's place with
    Prime-RL's batch receiver and checkpoint writer. Its admin URLs are the two replicas Dynamo's RL discovery lists;
    its rollouts go to a (Dynamo 1.6.1's vLLM sidecar refuses every request Prime-RL makes: see
    docs/guides/prime-rl-orchestrator.md).
    2 steps, Prime-RL's off-policy bound at 0 (a batch trains only on rollouts of the step's own weights). Once the
    startup weights (step 0) are on both, b's whole process group is SIGKILLed and restarted with the same command
    line while the orchestrator runs on: b comes back at step 0 from its record, then takes step 1 from the
    orchestrator like a. Checked: the orchestrator exits 0 after both steps with no failed rollout; every rollout of
    step k was sampled from v{k-1} and its logprobs are the trainer's own on those weights (1e-4: tito generated it
    with exactly the weights the orchestrator accounts it to); after each update both replicas' greedy answer to a
    probe is the trainer's on the weights it wrote; a never restarted; b serves the last step the orchestrator
    applied."""
    from scripts.prime_run.run import PrimeRun, prime_rl_missing

    if (why := prime_rl_missing()) is not None:
        pytest.skip(why)
    a, b = replicas
    rl_url = fleet["rl"]
    wait_for(lambda: len(rl_workers(rl_url)) == 2, 60, "both replicas in discovery")
    admins = sorted(_instances(rl_url))
    assert admins == sorted(r.url for r in replicas)
    a_pid = a.proc.pid
    run = PrimeRun(tmp_path_factory.mktemp("prime-rl-run"), model_dir(a), MODEL, a.url + "/v1", admins, steps=2,
                   max_off_policy_steps=0, lr=1e-3, timeout=900)
    probes: dict[int, list[list[int]]] = {}
    restart: dict[str, float] = {}

    def on_version(k: int) -> None:
        want = run.trainer_record(k)
        probes[k] = [_probe(r, want["probe"], len(want["probe_greedy"])) for r in replicas]
        assert probes[k] == [want["probe_greedy"]] * 2, (k, probes[k], want["probe_greedy"])
        if k == 0:  # between the startup weights and step 1's: SIGKILL b's process group, the same command again
            t0 = time.monotonic()
            b.kill()
            b.start(timeout=300)
            restart["up_s"] = time.monotonic() - t0
            assert _info(b)["state"]["weight_version"] == "step_0", _info(b)["state"]["weight_record"]
            wait_for(lambda: b.url in _instances(rl_url), 120, "b back in discovery")
            restart["discovery_s"] = time.monotonic() - t0

    res = run.run(on_version=on_version)
    assert res["orchestrator_exit"] == 0, run.tail("orchestrator")
    assert [s["step"] for s in res["steps_logged"]] == [1, 2], run.tail("orchestrator")
    assert all(s["error"] == 0 for s in res["steps_logged"]) and res["failed_rollouts"] == 0
    # v0 and v1 at least (v2 too when the trainer's last step lands before the orchestrator stops watching)
    assert {0, 1} <= set(probes) and restart, "the updates seen on both replicas, b restarted in between"
    for step in (1, 2):
        spans = res["effective_policy_versions"][step]
        assert spans and all(s == [step - 1, step - 1] for s in spans), (step, spans)
        gap = res["trainer"][step]["max_logprob_gap"]
        assert gap < 1e-4, f"step {step}: tito's logprobs {gap} from the trainer's on v{step - 1}"
    assert a.proc.pid == a_pid and a.proc.poll() is None  # one restart in all: b's
    for r in replicas:
        assert httpx.get(r.url + "/weight_info", timeout=30).json() == {"weight_version": f"step_{max(probes)}"}
    print(f"FLEET restart: b up (step 0 restored) {restart['up_s']:.1f}s after SIGKILL, back in discovery after "
          f"{restart['discovery_s']:.1f}s; Prime-RL's run: {res['rollouts']} rollouts, rewards "
          f"{[s['reward'] for s in res['steps_logged']]}, logprob gaps "
          f"{[r['max_logprob_gap'] for r in res['trainer'][1:]]}")


def _probe(r: ServerProcess, prompt: list[int], n: int) -> list[int]:
    out = httpx.post(r.url + GEN, timeout=300, json={"model": MODEL, "token_ids": prompt, "sampling_params": {
        "max_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert out.status_code == 200, out.text
    return list(out.json()["choices"][0]["token_ids"])
