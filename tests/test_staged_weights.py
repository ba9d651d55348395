"""Staged and sparse-delta weight updates on the real engine (the shared ``long_tito``): Prime-RL's stage/commit
sequence over each transport while a request generates, exactness against transformers and against a full load of
the same weights, the in-flight request's version spans across each commit, the contract's refusals, and a commit
that fails halfway (weights inconsistent until /reload_weights)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import torch

from app.tiny.model import TINY_CONFIG, tiny_state_dict
from tests import prime_stage_client as prime
from tests.conftest import FRESH_BODIES, fault_file
from tests.delta_encoder import BAD_DELTAS, perturb, write_delta
from tests.helpers import ServerProcess, greedy_answer, restore_server
from tests.rl_steps import PROMPTS, greedy, reference_greedy, start_endless, write_step

pytestmark = pytest.mark.engine
T = TypeVar("T")


def run(url: str, fn: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    async def main() -> T:
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            return await fn(c)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def server(long_tito: ServerProcess) -> Iterator[ServerProcess]:
    yield long_tito
    restore_server(long_tito.url)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, dict[str, torch.Tensor]]]:
    """Four trainer steps, each ~2% of every tensor changed from the one before, as step directories holding both
    containers; with each step's target weights."""
    root = tmp_path_factory.mktemp("deltas")
    sd = tiny_state_dict()
    out = []
    for step in range(1, 5):
        target = perturb(sd, 0.02, 100 + step)
        d = root / f"step_{step}"
        write_delta(d / "delta.safetensors", sd, target, "optimized" if step % 2 else "naive")
        write_delta(d / "delta.stream", sd, target, "optimized")
        (d / ".finished").touch()
        out.append((d, target))
        sd = target
    return out


def test_prime_stage_commit_over_every_transport(client: httpx.Client, server: ServerProcess, tito: ServerProcess,
                                                 chain: list[tuple[Path, dict[str, torch.Tensor]]],
                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """Per step: stage while a request streams, pause (keep) -> commit -> resume; the request's spans name the
    version before and after, contiguously; the server then answers exactly as transformers on the target weights.
    Then the same weights staged in full, and a delta back to the base weights, which answers as a fresh engine."""
    if client.get("/weight_status").json()["active_version"] != "base":  # a rerun after a failure midway
        assert client.post("/reload_weights").status_code == 200
    # The first stage starts the server's staging process (seconds on a busy machine): not while a request runs.
    empty = write_delta(tmp_path_factory.mktemp("warm-delta") / "delta.stream", tiny_state_dict(), tiny_state_dict())
    assert client.post("/stage", data={"version": "warm", "mode": "delta", "base_version": "base",
                                       "path": str(empty)}, timeout=600).status_code == 200
    ref_dir = tmp_path_factory.mktemp("delta-ref")
    prev_label, base = "default", "base"
    for step, ((d, target), transport) in enumerate(zip(chain, prime.TRANSPORTS, strict=True), start=1):
        version = str(step)
        bg = start_endless(client, server.url, f"delta-{step}")
        seen = len(bg.tokens)
        staged = run(server.url, lambda c, d=d, v=version, b=base, t=transport: prime.stage(c, d, v, b, t))
        assert staged["status"] == "ok" and staged["version"] == version, staged
        bg.wait_tokens(seen + 8)  # it kept generating while the stage ran
        r = run(server.url, lambda c, v=version: prime.commit(c, v))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["active_version"] == version and body["mode"] == "delta" and body["noop"] is False
        # Made ready before the pause (app/engine/worker_prebuild.py): the commit swapped the processed linear
        # layers in and wrote norms and the embedding in place; nothing was reloaded under the pause.
        w = body["workers"]
        assert w["prepared"] is True and w["prebuilt"] > 0 and w["reloaded_groups"] == 0, w
        assert client.get("/is_paused").json() == {"is_paused": False}
        bg.wait_tokens(len(bg.tokens) + 16)  # and went on after the commit, on the new weights
        bg.abort(client)
        choice = bg.result()["choices"][0]  # type: ignore[index]
        spans, n = choice["weight_versions"], len(choice["token_ids"])
        assert [s["version"] for s in spans] == [prev_label, version], spans
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == n
        assert greedy(client) == reference_greedy(target, ref_dir / version, PROMPTS, 8), transport
        prev_label = base = version
    status = client.get("/weight_status").json()
    assert status["active_version"] == "4" and status["staged"] == [] and status["weights_dirty"] is False
    info = client.get("/server_info").json()["state"]
    assert info["weight_version"] == "4" and {w["state"] for w in info["staging"]["workers"]} == {"ready"}
    # The server keeps the copy in a memory-mapped file (--delta-copy file): the chain above ran on it.
    assert {w["copy"] for w in info["staging"]["workers"]} == {"file"}
    metrics = client.get("/metrics").text
    for transport in prime.TRANSPORTS:
        assert f'tito_stages_total{{mode="delta",outcome="ok",transport="{transport}"}}' in metrics
    # The same weights staged in full (a checkpoint, loaded as a fresh engine loads one) answer identically.
    after_delta = greedy_answer(client)
    full = write_step(tmp_path_factory.mktemp("delta-full") / "step_4", chain[-1][1])
    r = client.post("/stage", data={"version": "4-full", "mode": "full", "path": str(full)})
    assert r.status_code == 200, r.text
    r = run(server.url, lambda c: prime.commit(c, "4-full", mode="full"))
    assert r.status_code == 200 and r.json()["mode"] == "full", r.text
    after_full = greedy_answer(client)
    assert after_delta["tokens"] == after_full["tokens"]
    assert after_delta["logprobs"] == pytest.approx(after_full["logprobs"], abs=1e-6)
    # A delta back to the base weights, on top of that full version: what the shared default server, a fresh engine
    # on them (the same tiny model; fp32), answered right after its start (conftest.FRESH_BODIES).
    back = write_delta(tmp_path_factory.mktemp("delta-back") / "delta.safetensors", chain[-1][1], tiny_state_dict())
    with back.open("rb") as f:
        r = client.post("/stage", data={"version": "5", "mode": "delta", "base_version": "4-full"},
                        files={"file": ("delta.safetensors", f, "application/octet-stream")})
    assert r.status_code == 200, r.text
    r = run(server.url, lambda c: prime.commit(c, "5"))
    assert r.status_code == 200 and r.json()["active_version"] == "5", r.text
    for body, want in zip(FRESH_BODIES, tito.fresh_answers, strict=True):
        got = client.post("/inference/v1/generate", json=body).json()["choices"][0]
        assert got["token_ids"] == want["token_ids"]
        if want["logprobs"] is not None:
            assert [e["logprob"] for e in got["logprobs"]["content"]] == \
                pytest.approx([e["logprob"] for e in want["logprobs"]["content"]], abs=1e-5)
    assert greedy_answer(client)["tokens"] != after_delta["tokens"]


def test_hf_tensors_map_onto_vllms_fused_parameters(server: ServerProcess) -> None:
    """The index mapping the in-place path writes through (CUDA's for every layer; here norms and the embedding),
    traced through vLLM's own loaders: q, k, v stacked in ``qkv_proj``, gate and up in ``gate_up_proj``."""
    cfg = TINY_CONFIG
    h, hd, nh, nkv, inter = (cfg[k] for k in ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads",
                                              "intermediate_size"))
    shapes = {"model.layers.0.self_attn.q_proj.weight": [nh * hd, h], "model.layers.0.self_attn.k_proj.weight":
              [nkv * hd, h], "model.layers.0.self_attn.v_proj.weight": [nkv * hd, h],
              "model.layers.1.mlp.gate_proj.weight": [inter, h], "model.layers.1.mlp.up_proj.weight": [inter, h],
              "model.layers.1.mlp.down_proj.weight": [h, inter], "model.embed_tokens.weight": [cfg["vocab_size"], h],
              "model.norm.weight": [h]}
    r = httpx.get(server.url + "/weight_layout", params={"name": ",".join(shapes)}, timeout=60)
    assert r.status_code == 200, r.text
    (got,) = r.json()["workers"]
    q, kv, gu = nh * hd * h, nkv * hd * h, inter * h
    assert got["model.layers.0.self_attn.q_proj.weight"] == {
        "param": "model.layers.0.self_attn.qkv_proj.weight", "shard": "q", "shape": [(nh + 2 * nkv) * hd, h],
        "inplace": False, "runs": [[0, 0, q]]}  # CPU: re-packed for oneDNN, processed ahead of the commit
    assert got["model.layers.0.self_attn.k_proj.weight"]["runs"] == [[0, q, kv]]
    assert got["model.layers.0.self_attn.v_proj.weight"]["runs"] == [[0, q + kv, kv]]
    assert got["model.layers.1.mlp.gate_proj.weight"]["shard"] == 0
    assert got["model.layers.1.mlp.gate_proj.weight"]["runs"] == [[0, 0, gu]]
    assert got["model.layers.1.mlp.up_proj.weight"] == {"param": "model.layers.1.mlp.gate_up_proj.weight",
                                                         "shard": 1, "shape": [2 * inter, h], "inplace": False,
                                                         "runs": [[0, gu, gu]]}
    for name, inplace in (("model.layers.1.mlp.down_proj.weight", False), ("model.embed_tokens.weight", True),
                          ("model.norm.weight", True)):
        n = 1
        for d in shapes[name]:
            n *= d
        assert got[name] == {"param": name, "shard": None, "shape": shapes[name], "inplace": inplace,
                             "runs": [[0, 0, n]]}, name
    assert httpx.get(server.url + "/weight_layout", params={"name": "nope.weight"}, timeout=60).status_code == 404


def test_contract_refusals_leave_the_model_untouched(client: httpx.Client, server: ServerProcess,
                                                     chain: list[tuple[Path, dict[str, torch.Tensor]]],
                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    assert client.post("/reload_weights", data={}).status_code == 200
    before = greedy(client)
    d1 = chain[0][0]

    def stage(**fields: Any) -> httpx.Response:
        return client.post("/stage", data={"mode": "delta", "path": str(d1), **fields})

    assert stage(version="1", base_version="3").status_code == 409  # not the active version
    assert stage(version="base", base_version="base").status_code == 409
    assert stage(version="1").status_code == 400  # no base_version
    assert client.post("/stage", data={"version": "1", "mode": "delta", "base_version": "base",
                                       "path": str(d1 / "missing")}).status_code == 404
    assert client.post("/commit", data={"version": "7", "mode": "delta"}).status_code == 404
    # Deltas the model cannot take (names, shapes, dtypes; a truncated file) are 400s at stage time; a chunked upload
    # whose bytes do not match its sha256 is a 409 at finalize. None reaches the engine.
    bad_dir = tmp_path_factory.mktemp("bad-delta")
    base_sd = tiny_state_dict()
    for i, (case, (b_change, t_change)) in enumerate(BAD_DELTAS.items()):
        bad = write_delta(bad_dir / str(i) / "delta.safetensors", {**base_sd, **b_change},
                          {**chain[0][1], **t_change})
        r = client.post("/stage", data={"version": "1", "mode": "delta", "base_version": "base", "path": str(bad)})
        assert r.status_code == 400, (case, r.text)
    cut = bad_dir / "cut" / "delta.stream"
    cut.parent.mkdir()
    cut.write_bytes((d1 / "delta.stream").read_bytes()[:-1000])
    r = client.post("/stage", data={"version": "1", "mode": "delta", "base_version": "base", "path": str(cut)})
    assert r.status_code == 400 and "bytes, the file has" in r.text, r.text
    raw = (d1 / "delta.safetensors").read_bytes()
    chunk = {"version": "1", "mode": "delta", "base_version": "base", "filename": "delta.safetensors",
             "total_size": str(len(raw)), "sha256": "0" * 64}
    r = client.post("/stage_chunk", data={**chunk, "offset": "0"}, files={"file": ("chunk", raw)})
    assert r.status_code == 200, r.text
    assert client.post("/stage_finalize", data=chunk).status_code == 409
    assert client.get("/weight_status").json()["staged"] == []
    assert stage(version="1", base_version="base").status_code == 200
    assert client.post("/commit", data={"version": "1", "mode": "full"}).status_code == 409
    assert greedy(client) == before and client.get("/weight_info").json() == {"weight_version": "default"}
    # An empty delta is valid: a new version, the same weights.
    empty = write_delta(tmp_path_factory.mktemp("empty-delta") / "delta.stream", tiny_state_dict(), tiny_state_dict())
    assert client.post("/stage", data={"version": "0", "mode": "delta", "base_version": "base",
                                       "path": str(empty.parent)}).status_code == 200
    r = client.post("/commit", data={"version": "0", "mode": "delta"})
    assert r.status_code == 200 and r.json()["active_version"] == "0", r.text
    assert greedy(client) == before and client.get("/weight_info").json() == {"weight_version": "0"}


def test_a_superseded_stage_is_taken_back_out_of_the_copy(client: httpx.Client, server: ServerProcess,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two deltas staged on the same base: the workers made the first ready (added to their copy, layers processed),
    then the second replaced it (the first taken back out). Committing the first anyway applies it under the pause
    from a copy that must be back at the base; the delta after it is made ready again. Each answers as transformers
    on its target weights (tokens, and logprobs to 1e-4): a copy left with the other delta's elements would not."""
    from tests.reference import Reference

    def matches(sd: dict[str, torch.Tensor], name: str) -> list[float]:
        ref = Reference(write_step(root / name, {k: v.float() for k, v in sd.items()}, config=True))
        want = ref.greedy([3, 1, 4, 1, 5], 12)
        got = greedy_answer(client)
        assert got["tokens"] == want[0], name
        assert got["logprobs"] == pytest.approx(want[1], abs=1e-4), name
        return want[1]

    assert client.post("/reload_weights").status_code == 200
    root = tmp_path_factory.mktemp("superseded")
    base_sd = tiny_state_dict()
    a, b = perturb(base_sd, 0.02, 71), perturb(base_sd, 0.02, 72)
    deltas = {"A": write_delta(root / "A" / "delta.stream", base_sd, a),
              "B": write_delta(root / "B" / "delta.stream", base_sd, b),
              "C": write_delta(root / "C" / "delta.stream", a, b)}

    def stage(version: str, base: str) -> None:
        r = client.post("/stage", data={"version": version, "mode": "delta", "base_version": base,
                                        "path": str(deltas[version])}, timeout=300)
        assert r.status_code == 200, r.text

    def ready(version: str) -> dict[str, Any]:
        for _ in range(600):
            (w,) = client.get("/weight_status").json()["workers"]
            if (w.get("pending") or {}).get("version") == version and w["pending"]["state"] != "preparing":
                return w["pending"]
            time.sleep(0.1)
        raise AssertionError(w)

    stage("A", "base")
    assert ready("A")["state"] == "ready"
    stage("B", "base")
    assert ready("B")["state"] == "ready"
    r = run(server.url, lambda c: prime.commit(c, "A"))
    assert r.status_code == 200 and r.json()["workers"]["prepared"] is False, r.text
    lp_a = matches(a, "ref-A")
    stage("C", "A")
    r = run(server.url, lambda c: prime.commit(c, "C"))
    assert r.status_code == 200 and r.json()["workers"]["prepared"] is True, r.text
    lp_b = matches(b, "ref-B")
    assert max(abs(x - y) for x, y in zip(lp_a, lp_b, strict=True)) > 1e-3  # the two targets tell apart


def test_a_commit_failing_halfway_leaves_the_weights_inconsistent(client: httpx.Client, server: ServerProcess,
                                                                  chain: list[tuple[Path, dict[str, Any]]],
                                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    assert client.post("/reload_weights").status_code == 200
    base_answer = greedy(client)
    stage = {"version": "1", "mode": "delta", "base_version": "base", "path": str(chain[0][0])}
    # A failure before the model changes (tito's prepared copy of the delta damaged on disk, and another delta made
    # ready since, so the commit reads it again): 500, still consistent.
    assert client.post("/stage", data=stage).status_code == 200
    staging = Path(client.get("/server_info").json()["state"]["staging"]["directory"])
    (prepared,) = staging.glob("versions/*/prepared.stream")
    assert client.post("/stage", data={**stage, "version": "1b"}).status_code == 200
    prepared.write_bytes(prepared.read_bytes()[:-100])
    r = run(server.url, lambda c: prime.commit(c, "1"))
    assert r.status_code == 500 and "unreadable" in r.text, r.text
    assert client.get("/weight_status").json()["weights_dirty"] is False
    assert client.get("/is_paused").json() == {"is_paused": False} and greedy(client) == base_answer
    # A failure after it started to change: the weights are inconsistent until /reload_weights.
    assert client.post("/stage", data=stage).status_code == 200
    fault_file(tmp_path_factory).write_text("read:5")  # the worker's next load fails at its 5th tensor
    r = run(server.url, lambda c: prime.commit(c, "1"))
    assert r.status_code == 500, r.text
    status = client.get("/weight_status").json()
    assert status["weights_dirty"] is True and status["active_version"] == "base"
    assert client.post("/resume").status_code == 409
    assert client.post("/inference/v1/generate", json={"token_ids": [1], "sampling_params": {"max_tokens": 1}}
                       ).status_code == 503
    assert client.post("/stage", data={"version": "1", "mode": "delta", "base_version": "base",
                                       "path": str(chain[0][0])}).status_code == 409
    assert client.post("/reload_weights").status_code == 200
    assert client.post("/resume").status_code == 200
    assert greedy(client) == base_answer
    after = client.get("/weight_status").json()
    assert after["weights_dirty"] is False and after["serving_ready"] is True and after["active_version"] == "base"
