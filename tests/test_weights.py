"""RL weight updates from disk on the real engine: the RL loop against transformers and a fresh engine, idempotency,
sharded checkpoints, reload, invalid checkpoints refused with the model untouched, vLLM's native weight routes.
Pause modes and concurrent updates: test_weights_pause.py."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from app.tiny.model import tiny_state_dict
from tests.conftest import FRESH_BODIES
from tests.helpers import metric_value
from tests.rl_steps import (
    GEN,
    PROMPTS,
    greedy,
    reference_greedy,
    rl_step,
    update,
    weight_module_fixtures,
    write_step,
)

pytestmark = pytest.mark.engine
root, server, client = weight_module_fixtures()  # the long-context server, put back at the end


@pytest.fixture(scope="module")
def base_greedy(root: Path) -> list:
    return reference_greedy(tiny_state_dict(), root / "ref-base", PROMPTS, 8)


# ------------------------------------------------------------------------------------------ the RL loop


def test_rl_loop_matches_fresh_weights(client, root, base_greedy):
    assert greedy(client) == base_greedy
    for step, seed in ((1, 11), (2, 22)):
        sd = tiny_state_dict(seed)
        d = write_step(root / "run" / f"step_{step}", sd)
        body = rl_step(client, d)
        assert body["weight_version"] == f"step_{step}" and body["noop"] is False
        assert body["bytes"] == (d / "model.safetensors").stat().st_size
        # vLLM's reload is timed inside the update, so it is part of (and less than) the whole.
        assert 0 < body["reload_seconds"] < body["seconds"]
        want = reference_greedy(sd, root / f"ref-step{step}", PROMPTS, 8)
        got = greedy(client)
        assert got == want and got != base_greedy
        assert client.get("/weight_info").json() == {"weight_version": f"step_{step}"}
        r = client.post(GEN, json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 3, "temperature": 0}})
        assert r.json()["choices"][0]["weight_versions"] == [{"version": f"step_{step}", "start": 0, "end": 3}]
    assert client.get("/is_paused").json() == {"is_paused": False}


def test_matches_a_fresh_engine_on_the_new_weights(client, root, tito):
    """Once against a real second engine (not only transformers): what the session's default server, started on
    the tiny model's weights, answered before any test could touch it (conftest.FRESH_BODIES), against this server
    updated to those weights from another step's (an update from a checkpoint directory, not a reload)."""
    fresh = tito.fresh_answers
    rl_step(client, root / "run" / "step_2", weight_version="step_2-again")
    step2 = client.post(GEN, json=FRESH_BODIES[0]).json()["choices"][0]
    assert step2["logprobs"] != fresh[0]["logprobs"]  # step_2's weights answer otherwise
    rl_step(client, write_step(root / "run" / "base-again", tiny_state_dict()), weight_version="base-again")
    for body, b in zip(FRESH_BODIES, fresh, strict=True):
        a = client.post(GEN, json=body).json()["choices"][0]
        assert a["token_ids"] == b["token_ids"]
        if b["logprobs"] is not None:
            assert [e["logprob"] for e in a["logprobs"]["content"]] == \
                pytest.approx([e["logprob"] for e in b["logprobs"]["content"]], abs=1e-5)


def test_retry_is_a_noop_and_metrics_count_once(client, root):
    sd = tiny_state_dict(33)
    d = write_step(root / "run" / "step_3", sd)
    before = metric_value(client.get("/metrics").text, "tito_weight_updates_total",
                          {"source": "disk", "outcome": "ok"}) or 0.0
    first = rl_step(client, d)
    second = rl_step(client, d)
    assert first["noop"] is False and second["noop"] is True
    assert second["weight_version"] == first["weight_version"] == "step_3"
    after = metric_value(client.get("/metrics").text, "tito_weight_updates_total",
                         {"source": "disk", "outcome": "ok"})
    assert after == before + 1
    text = client.get("/metrics").text
    assert 'tito_weight_version_info{version="step_3"}' in text
    # A new explicit version for the same directory is a new update, not a no-op.
    third = rl_step(client, d, weight_version="v3b")
    assert third["noop"] is False and third["weight_version"] == "v3b"


def test_sharded_checkpoint_with_buffers_and_other_dtype(client, root, server):
    sd = tiny_state_dict(44)
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16)
    ck = dict(sd)
    ck["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.arange(32, dtype=torch.float32)
    ck["model.layers.1.self_attn.rotary_emb.inv_freq"] = torch.arange(32, dtype=torch.float32)
    d = write_step(root / "run" / "step_4", ck, shards=3)
    body = rl_step(client, d, mode="abort")
    assert body["weight_version"] == "step_4"
    assert greedy(client) == reference_greedy(sd, root / "ref-step4", PROMPTS, 8)
    log = server.log_text()
    assert "skipping 2 non-parameter buffer(s)" in log
    assert "model.layers.0.mlp.up_proj.weight BF16->F32" in log
    assert "weights updated from disk: version=step_4" in log and "bytes in" in log


def test_reload_weights_rereads_the_served_model(client, base_greedy):
    r = client.post("/reload_weights")
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == "default"
    assert greedy(client) == base_greedy


# ------------------------------------------------------------------------------------------ invalid checkpoints


def _corrupt_header(d: Path) -> None:
    write_step(d, tiny_state_dict(5))
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[:8] + b"{not json" + raw[17:])


def _truncated(d: Path) -> None:
    write_step(d, tiny_state_dict(5))
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[: len(raw) // 2])


def _huge_header_len(d: Path) -> None:
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")


def _missing_shard(d: Path) -> None:
    write_step(d, tiny_state_dict(5), shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()


def _extra_tensor(d: Path) -> None:
    sd = tiny_state_dict(5)
    sd["model.layers.9.mlp.gate_proj.weight"] = torch.zeros(2, 2)
    write_step(d, sd)


def _missing_tensor(d: Path) -> None:
    sd = tiny_state_dict(5)
    del sd["model.layers.1.mlp.down_proj.weight"]
    write_step(d, sd)


def _shape_mismatch(d: Path) -> None:
    sd = tiny_state_dict(5)
    sd["model.norm.weight"] = torch.ones(64)
    write_step(d, sd)


def _empty(d: Path) -> None:
    d.mkdir(parents=True)
    (d / "STABLE").touch()


BAD = {
    "missing_dir": (lambda d: None, 404, "does not exist"),
    "no_safetensors": (_empty, 400, "no safetensors files"),
    "corrupt_header": (_corrupt_header, 400, "corrupt"),
    "truncated": (_truncated, 400, "truncated"),
    "huge_header_length": (_huge_header_len, 400, "corrupt or truncated"),
    "missing_shard": (_missing_shard, 400, "missing shard(s)"),
    "extra_tensor": (_extra_tensor, 400, "tensor(s) the model lacks: model.layers.9.mlp.gate_proj.weight"),
    "missing_tensor": (_missing_tensor, 400, "missing 1 tensor(s) of the model: model.layers.1.mlp.down_proj"),
    "shape_mismatch": (_shape_mismatch, 400, "shape mismatch for 'model.norm.weight'"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_invalid_checkpoint_is_refused_and_model_untouched(client, root, kind):
    make, status, words = BAD[kind]
    d = root / "bad" / kind
    make(d)
    before = greedy(client)
    version = client.get("/weight_info").json()
    r = update(client, d)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["code"] == status and err["param"] == "weight_dir"
    assert greedy(client) == before
    assert client.get("/weight_info").json() == version


def test_weight_dir_outside_allowed_roots_is_403(client, base_greedy):
    r = update(client, "/etc")
    assert r.status_code == 403, r.text
    r = client.post("/update_weights", json={})
    assert r.status_code == 400 and "no broadcaster" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------------------ vLLM native routes


def test_native_weight_routes(client):
    r = client.post("/update_weight_version", json={"new_version": "v-native"})
    assert r.json() == {"success": True, "new_version": "v-native"}
    assert client.get("/weight_info").json() == {"weight_version": "v-native"}
    spans = client.post(GEN, json={"token_ids": [1], "sampling_params": {"max_tokens": 2}}).json()
    assert spans["choices"][0]["weight_versions"][0]["version"] == "v-native"
    assert client.get("/get_world_size").json() == {"world_size": 1}
    assert client.get("/get_world_size", params={"include_dp": "false"}).json() == {"world_size": 1}
    # Every vLLM weight-transfer backend needs a GPU: a clear 501 here, not a crash.
    for path, body in (("/init_weight_transfer_engine", {"init_info": {"master_address": "x"}}),
                       ("/start_weight_update", {}), ("/update_weights", {"update_info": {"names": []}}),
                       ("/finish_weight_update", {"weight_version": "x"})):
        r = client.post(path, json=body)
        assert r.status_code == 501, (path, r.text)
        assert "GPU" in r.json()["error"]["message"]
    assert client.post("/init_weight_transfer_engine", json={}).status_code == 400
    assert client.post("/update_weight_version", json={}).status_code == 400
    assert client.post("/pause", params={"mode": "bogus"}).status_code == 400
    assert client.get("/is_paused").json() == {"is_paused": False}
