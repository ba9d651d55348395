"""The trainers' own launchers start tito: the `vllm serve` arguments Prime-RL's and AReaL's code builds, with the
program swapped for `tito serve` and only this machine's values set (model path, dtype, context, memory share, block
size). Each starts and serves, with the settings its arguments imply in effect: processed logprobs by value against
transformers, tool calls through vLLM's parser, the fp32 LM head, a trainer's worker extension left to tito's.

Prime-RL's launcher (``prime_rl.configs.inference.InferenceConfig.to_namespace()``, from the source snapshot in
shared/thirdparty/prime-rl) hands vLLM's parser a namespace instead of a command line: tito's ``namespace_argv``
(app/engine/vllm_args.py, what docs/guides/trainers.md tells Prime-RL users to run) writes it as the command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import start_timeout
from tests.helpers import ServerProcess, engine_env, free_port
from tests.logprob_modes import check_logprobs_mode
from tests.prime_rl_src import PRIME_CONTEXT, PRIME_MODEL
from tests.test_areal import areal_python

pytestmark = pytest.mark.engine

GEN = "/inference/v1/generate"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def prime(prime_tito: ServerProcess) -> ServerProcess:
    """The shared server started with Prime-RL's launcher's command line (tests/conftest.py ``prime_tito``), on the
    tiny tied model; these tests run on its base weights, before test_prime_rl_writer.py updates them."""
    return prime_tito


@pytest.fixture(scope="module")
def prime_client(prime: ServerProcess) -> Any:
    with httpx.Client(base_url=prime.url, timeout=120.0) as c:
        yield c


def model_of(server: ServerProcess) -> str:
    return server.cmd[server.cmd.index("--model") + 1]


def test_prime_rl_launcher_defaults_are_taken(prime: ServerProcess, prime_client: httpx.Client) -> None:
    """The arguments Prime-RL's launcher builds by default (tito refused seven of them before) all start tito, and
    /server_info shows them in effect."""
    argv = prime.launch_argv  # type: ignore[attr-defined]
    for flag in ("--tool-call-parser", "--data-parallel-rpc-port", "--api-server-count", "--all2all-backend",
                 "--enable-auto-tool-choice", "--logprobs-mode", "--additional-config"):
        assert flag in argv, (flag, argv)
    info = prime_client.get("/server_info").json()
    assert info["model"]["logprobs_mode"] == "processed_logprobs"
    assert info["model"]["head_dtype"] == "float32"  # Prime-RL's fp32_lm_head, as vLLM's head_dtype override
    assert info["features"]["tool_call_parser"] == "hermes" and info["features"]["auto_tool_choice"] is True
    assert info["vllm_args"]["all2all_backend"] == "allgather_reducescatter"
    config = prime_client.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert config["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert config["model_config"]["hf_overrides"] == {"head_dtype": "float32"}
    assert config["parallel_config"]["data_parallel_rpc_port"] == 13345
    # Prime-RL's model check: /v1/models names the model it asked for; the model ties its head, as Qwen3-0.6B.
    assert [m["id"] for m in prime_client.get("/v1/models").json()["data"]] == [PRIME_MODEL]
    assert json.loads((Path(model_of(prime)) / "config.json").read_text())["tie_word_embeddings"] is True
    assert "fp32_router_logits: no MoE router in this model (Qwen3ForCausalLM)" in prime.log_text()


def test_prime_rl_logprobs_are_processed(prime: ServerProcess, prime_client: httpx.Client) -> None:
    """`logprobs` under Prime-RL's launcher are the distribution sampled from: log_softmax of the logits after
    temperature and top-k (transformers on the same weights; an fp32 head on an fp32 model changes nothing else)."""
    check_logprobs_mode(prime_client, model_of(prime), "processed_logprobs", model=PRIME_MODEL)


def test_default_logprobs_are_raw(tito_url: str, tiny_model: Path) -> None:
    """vLLM's default, and tito's without a --logprobs-mode: the model's own distribution, before temperature."""
    with httpx.Client(base_url=tito_url, timeout=60.0) as c:
        check_logprobs_mode(c, str(tiny_model), "raw_logprobs")


def _chat(client: httpx.Client, tool_choice: Any, max_tokens: int, model: str = PRIME_MODEL) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER], "tool_choice": tool_choice, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0])


def check_named_tool_call(client: httpx.Client, model: str) -> None:
    """A named function comes back as `tool_calls` whose arguments vLLM's structured outputs hold to the schema, even
    from a random model."""
    named = _chat(client, {"type": "function", "function": {"name": "get_weather"}}, 200, model)
    calls = named["message"].get("tool_calls")
    assert calls and len(calls) == 1 and calls[0]["function"]["name"] == "get_weather", named
    args = json.loads(calls[0]["function"]["arguments"])
    assert set(args) == {"city"} and args["city"] in ("Paris", "Rome"), args


def test_prime_rl_tool_calls(prime_client: httpx.Client, tito_url: str) -> None:
    """Tool calling as Prime-RL's launcher configures it (hermes, auto tool choice): `auto` is answered, where a
    server without the launcher's arguments answers 400. (The named call is checked on the AReaL launcher's untied
    model, below: the tied random model repeats its last token, its logits being mostly its input's embedding, and
    so fills a forced JSON with the whitespace JSON allows between tokens.)"""
    auto = _chat(prime_client, "auto", 8)
    assert auto["finish_reason"] in ("length", "stop", "tool_calls")
    with httpx.Client(base_url=tito_url, timeout=60.0) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        r = c.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 4})
        assert r.status_code == 400 and "--tool-call-parser" in r.text, r.text


def test_areal_launcher(tmp_path: Path, tiny_model: Path) -> None:
    """AReaL 1.0.4's own ``vLLMConfig.build_cmd``, with its program swapped for `tito serve`: AReaL's worker
    extension is left to tito's (its update routes are tito's own), prefix caching off as AReaL asks, its LoRA and
    scheduler settings in effect."""
    py = areal_python()
    port = free_port()
    code = (
        "import json, sys\n"
        "from areal.api.cli_args import vLLMConfig\n"
        f"cfg = vLLMConfig(model={str(tiny_model)!r}, dtype='float32', max_model_len={PRIME_CONTEXT}, "
        "gpu_memory_utilization=0.3, block_size=128)\n"
        f"json.dump(vLLMConfig.build_cmd(cfg, tp_size=1, pp_size=1, host='127.0.0.1', port={port}), sys.stdout)\n")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    cmd = json.loads(out.stdout)
    assert cmd[:3] == ["python3", "-m", "areal.engine.vllm_ext.areal_vllm_server"], cmd
    # AReaL's config has no tool-call parser; an evaluation that calls tools adds vLLM's arguments to its command.
    tools = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    server = ServerProcess([sys.executable, "-m", "tito", "serve", *cmd[3:], *tools], port,
                           tmp_path / "areal-launch.log", env=engine_env(None))
    try:
        server.start(timeout=start_timeout())
        info = httpx.get(server.url + "/server_info", timeout=30).json()
        assert info["features"]["prefix_caching"] is False
        assert info["vllm_args"]["worker_extension_cls"].startswith("areal.")
        assert info["features"]["max_loras"] == 0  # AReaL's LoRA settings apply once it asks for LoRA
        assert info["model"]["max_num_seqs"] == 256 and info["model"]["kv_block_size"] == 128
        assert "--worker-extension-cls areal.engine.vllm_ext.vllm_worker_extension.VLLMWorkerExtension: not loaded" \
            in server.log_text()
        r = httpx.post(server.url + GEN, json={"token_ids": [3, 1, 4], "sampling_params": {"max_tokens": 4,
                                                                                        "temperature": 0}}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4, r.text
        with httpx.Client(base_url=server.url, timeout=120.0) as c:
            check_named_tool_call(c, str(tiny_model))
    finally:
        server.kill()
