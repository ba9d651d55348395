"""Metadata routes on the shared server: /v1/models, /version, /server_info (schema, state, route map)."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.engine

# tito's sections, and vLLM's own keys beside them (what clients reading a vLLM server's /server_info parse).
SECTIONS = {"schema_version", "server", "model", "parallelism", "features", "state", "api_processes", "dynamo",
            "routes", "vllm_config", "vllm_env", "vllm_args"}
KEYS = {
    "server": {"name", "version", "vllm_version", "pid", "host", "port", "started_at", "started_at_unix", "uptime_s"},
    "model": {"served_model_name", "path", "dtype", "max_model_len", "vocab_size", "max_num_seqs", "max_logprobs",
              "has_tokenizer", "tokenizer_loaded", "logprobs_mode", "head_dtype"},
    "parallelism": {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "world_size",
                    "data_parallel_rank_start", "data_parallel_rank_end", "api_server_count"},
    "features": {"lora", "max_loras", "max_lora_rank", "prompt_logprobs", "min_tokens", "routed_experts",
                 "prefix_caching", "priority_scheduling", "tool_call_parser", "auto_tool_choice", "reasoning_parser"},
    "state": {"engine", "engine_error", "ready", "not_ready_reason", "draining", "shutting_down", "paused",
              "inflight", "weight_version", "loaded_adapters"},
    "routes": {"base_url", "generate_url", "generate_path", "admin", "data", "open", "all"},
}


def _info(client: httpx.Client) -> dict:
    r = client.get("/server_info")
    assert r.status_code == 200, r.text
    return r.json()


def test_models_lists_the_base_model_with_max_model_len(client, tito):
    r = client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    base = body["data"][0]
    info = _info(client)
    assert base["id"] == info["model"]["served_model_name"]
    assert base["object"] == "model" and base["parent"] is None
    assert base["max_model_len"] == 512  # the tiny model's max_position_embeddings
    assert all(card["parent"] == base["id"] for card in body["data"][1:])


def test_version_route(client):
    import vllm

    from app import __version__

    body = client.get("/version").json()
    assert body == {"version": __version__, "vllm_version": vllm.__version__}
    assert body["vllm_version"].startswith("0.32")


def test_server_info_schema_and_values(client, tito):
    info = _info(client)
    assert set(info) == SECTIONS
    assert info["schema_version"] == 1
    for section, keys in KEYS.items():
        assert set(info[section]) >= keys, (section, keys - set(info[section]))
    srv, model, par, st = info["server"], info["model"], info["parallelism"], info["state"]
    assert srv["name"] == "tito" and srv["port"] == tito.port
    assert isinstance(srv["pid"], int) and srv["pid"] == tito.proc.pid
    assert 0 < srv["started_at_unix"] <= time.time() and srv["uptime_s"] >= 0
    assert model["max_model_len"] == 512 and model["vocab_size"] == 512 and model["dtype"] == "float32"
    assert par == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                   "world_size": 1, "data_parallel_rank_start": 0, "data_parallel_rank_end": 1, "api_server_count": 1}
    assert info["api_processes"] is None  # one process: none listed
    assert info["features"]["lora"] is False and info["features"]["routed_experts"] is False
    assert st["engine"] == "alive" and st["engine_error"] is None
    assert st["ready"] is True and st["not_ready_reason"] is None
    assert st["draining"] is False and st["paused"] is False
    assert st["weight_version"] == client.get("/weight_info").json()["weight_version"]
    assert st["loaded_adapters"] == []
    assert info["dynamo"] is None  # no --dynamo-namespace: no child sidecar
    # What a restart restores: the tests' state directory (XDG_STATE_HOME), nothing committed yet on this server.
    rec = st["weight_record"]
    assert rec["state_dir"] and rec["restore_error"] is None and rec["write_error"] is None
    # uptime moves
    deadline = time.monotonic() + 10
    while _info(client)["server"]["uptime_s"] <= srv["uptime_s"]:
        assert time.monotonic() < deadline, "uptime_s did not move"
        time.sleep(0.01)


def test_route_map_is_the_apps_own_routes(client, tito):
    routes = _info(client)["routes"]
    assert routes["generate_url"] == tito.url + "/inference/v1/generate"
    assert routes["base_url"] == tito.url
    # Derived from the running app: exactly the paths of its OpenAPI schema.
    openapi_paths = set(client.get("/openapi.json").json()["paths"])
    assert {r["path"] for r in routes["all"]} == openapi_paths
    assert {"/pause", "/resume", "/update_weights", "/drain", "/load_lora_adapter"} <= set(routes["admin"])
    assert "/inference/v1/generate" in routes["data"] and "/v1/models" in routes["data"]
    assert {"/health", "/metrics", "/version"} <= set(routes["open"])
    assert not set(routes["admin"]) & set(routes["data"])
    gen = next(r for r in routes["all"] if r["path"] == "/inference/v1/generate")
    assert gen["methods"] == ["POST"] and gen["plane"] == "data"


def test_server_info_follows_pause_and_drain(client):
    """The state section tells the truth as it changes (the shared server is restored whatever happens)."""
    try:
        assert client.post("/pause", params={"mode": "keep"}).status_code == 200
        st = _info(client)["state"]
        assert st["paused"] is True
        assert client.post("/resume").status_code == 200
        assert _info(client)["state"]["paused"] is False

        assert client.post("/drain", json={"timeout": 1}).status_code == 200
        st = _info(client)["state"]
        assert st["draining"] is True and st["ready"] is False and st["not_ready_reason"] == "draining"
        assert client.delete("/drain").status_code == 200
        st = _info(client)["state"]
        assert st["draining"] is False and st["ready"] is True
    finally:
        client.post("/resume")
        client.delete("/drain")
