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

from app.engine.vllm_args import namespace_argv
from tests.conftest import module_server, start_timeout
from tests.helpers import ROOT, ServerProcess, engine_env, free_port
from tests.logprob_modes import check_logprobs_mode
from tests.test_areal import areal_python

pytestmark = pytest.mark.engine

PRIME_RL = ROOT.parent / "shared" / "thirdparty" / "prime-rl"
PRIME_PATH = os.pathsep.join(str(PRIME_RL / p) for p in ("src", "packages/prime-rl-configs/src"))
PRIME_MODEL = "Qwen/Qwen3-0.6B"  # the name Prime-RL's launcher resolves its parsers from (hermes for Qwen3)
CONTEXT = 512
GEN = "/inference/v1/generate"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}


def prime_namespace(port: int) -> dict[str, Any]:
    """Prime-RL's launcher namespace for a Qwen3 model at its defaults; only this machine's values are set."""
    if not PRIME_RL.is_dir():
        pytest.skip(f"Prime-RL's source snapshot is missing: {PRIME_RL}")
    code = (
        "import json, sys\n"
        "from prime_rl.configs.inference import InferenceConfig\n"
        f"c = InferenceConfig(server={{'port': {port}}}, vllm={{'model': {PRIME_MODEL!r}, 'dtype': 'float32', "
        f"'max_model_len': {CONTEXT}, 'gpu_memory_utilization': 0.3}})\n"
        "json.dump(vars(c.to_namespace()), sys.stdout)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": PRIME_PATH}, check=True)
    return dict(json.loads(out.stdout))


@module_server("prime-launch")
def start_prime(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> ServerProcess:
    port = free_port()
    argv = namespace_argv(prime_namespace(port))
    # No model hub here: the model's name is served from the tiny model's directory, under the same name.
    at = argv.index("--model")
    argv[at + 1:at + 2] = [str(tiny_model), "--served-model-name", PRIME_MODEL]
    log = tmp_path_factory.mktemp("logs") / "prime-launch.log"
    server = ServerProcess([sys.executable, "-m", "tito", "serve", *argv], port, log, env=engine_env(None))
    server.launch_argv = argv  # type: ignore[attr-defined]
    return server.start(timeout=start_timeout())


@pytest.fixture(scope="module")
def prime(shared_servers: Any) -> ServerProcess:
    return shared_servers.get("prime-launch")


@pytest.fixture(scope="module")
def prime_client(prime: ServerProcess) -> Any:
    with httpx.Client(base_url=prime.url, timeout=120.0) as c:
        yield c


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
    # Prime-RL's model check: /v1/models names the model it asked for.
    assert [m["id"] for m in prime_client.get("/v1/models").json()["data"]] == [PRIME_MODEL]
    assert "fp32_router_logits: no MoE router in this model (Qwen3ForCausalLM)" in prime.log_text()


def test_prime_rl_logprobs_are_processed(prime: ServerProcess, prime_client: httpx.Client, tiny_model: Path) -> None:
    """`logprobs` under Prime-RL's launcher are the distribution sampled from: log_softmax of the logits after
    temperature and top-k (transformers on the same weights; an fp32 head on an fp32 model changes nothing else)."""
    check_logprobs_mode(prime_client, str(tiny_model), "processed_logprobs", model=PRIME_MODEL)


def test_default_logprobs_are_raw(tito_url: str, tiny_model: Path) -> None:
    """vLLM's default, and tito's without a --logprobs-mode: the model's own distribution, before temperature."""
    with httpx.Client(base_url=tito_url, timeout=60.0) as c:
        check_logprobs_mode(c, str(tiny_model), "raw_logprobs")


def _chat(client: httpx.Client, tool_choice: Any, max_tokens: int) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={
        "model": PRIME_MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER], "tool_choice": tool_choice, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0])


def test_prime_rl_tool_calls(prime_client: httpx.Client) -> None:
    """Tool calling as Prime-RL's launcher configures it (hermes, auto tool choice): `auto` is answered, and a named
    function comes back as `tool_calls` whose arguments vLLM's structured outputs hold to the schema, even from a
    random model."""
    auto = _chat(prime_client, "auto", 8)
    assert auto["finish_reason"] in ("length", "stop", "tool_calls")
    named = _chat(prime_client, {"type": "function", "function": {"name": "get_weather"}}, 200)
    calls = named["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather", named
    args = json.loads(calls[0]["function"]["arguments"])
    assert set(args) == {"city"} and args["city"] in ("Paris", "Rome"), args


def test_areal_launcher(tmp_path: Path, tiny_model: Path) -> None:
    """AReaL 1.0.4's own ``vLLMConfig.build_cmd``, with its program swapped for `tito serve`: AReaL's worker
    extension is left to tito's (its update routes are tito's own), prefix caching off as AReaL asks, its LoRA and
    scheduler settings in effect."""
    py = areal_python()
    if py is None:
        pytest.skip("AReaL's venv is missing: make areal (TITO_AREAL_VENV)")
    port = free_port()
    code = (
        "import json, sys\n"
        "from areal.api.cli_args import vLLMConfig\n"
        f"cfg = vLLMConfig(model={str(tiny_model)!r}, dtype='float32', max_model_len={CONTEXT}, "
        "gpu_memory_utilization=0.3, block_size=128)\n"
        f"json.dump(vLLMConfig.build_cmd(cfg, tp_size=1, pp_size=1, host='127.0.0.1', port={port}), sys.stdout)\n")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    cmd = json.loads(out.stdout)
    assert cmd[:3] == ["python3", "-m", "areal.engine.vllm_ext.areal_vllm_server"], cmd
    server = ServerProcess([sys.executable, "-m", "tito", "serve", *cmd[3:]], port, tmp_path / "areal-launch.log",
                           env=engine_env(None))
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
    finally:
        server.kill()
