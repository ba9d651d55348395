"""`tito serve`'s command line is vLLM's (app/engine/vllm_args.py): every argument of vLLM's serve parser goes
somewhere tito says, tito's settings that vLLM also defines are one argument, and what tito cannot honour stops the
start with exit 2 and one line naming it. No engine starts here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs

from app.core.settings import FLAGS
from app.engine.vllm_args import (
    HANDLER_OPTIONS,
    REFUSED,
    SERVER_OPTIONS,
    ServeArgsError,
    engine_options,
    frontend_options,
    parse_serve,
    serve_parser,
    vllm_defaults,
)
from app.server.security import Keys
from tito.cli import main

# Each refused argument, given with a value other than vLLM's default.
REFUSED_ARGV = {
    "headless": ["--headless"], "grpc": ["--grpc"], "uds": ["--uds", "/tmp/tito.sock"],
    "enable_ssl_refresh": ["--enable-ssl-refresh"], "tokens_only": ["--tokens-only"],
    "tool_server": ["--tool-server", "demo"],
    "enable_server_load_tracking": ["--enable-server-load-tracking"],
    "enable_tokenizer_info_endpoint": ["--enable-tokenizer-info-endpoint"],
    "enable_offline_docs": ["--enable-offline-docs"], "sse_keep_alive_interval": ["--sse-keep-alive-interval", "5"],
    "cohere_is_reasoning_model": ["--no-cohere-is-reasoning-model"],
    "data_parallel_supervisor_port": ["--data-parallel-supervisor-port", "9300"],
    "dp_supervisor_probe_interval_s": ["--dp-supervisor-probe-interval-s", "2"],
    "dp_supervisor_probe_timeout_s": ["--dp-supervisor-probe-timeout-s", "2"],
    "dp_supervisor_probe_failure_threshold": ["--dp-supervisor-probe-failure-threshold", "5"],
    "disable_log_stats": ["--disable-log-stats"],
    "data_parallel_multi_port_external_lb": ["--data-parallel-multi-port-external-lb"],
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A directory as --model names one (nothing here loads it)."""
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    return tmp_path


def test_every_vllm_argument_goes_somewhere() -> None:
    """A vLLM upgrade that adds a front-end argument fails here until tito says what it does with it (engine
    arguments need no word: they reach the engine as `vllm serve` passes them)."""
    engine = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    tito = {f.name for f in FLAGS}
    unplaced = [d for d in vllm_defaults()
                if d not in engine | tito | HANDLER_OPTIONS | SERVER_OPTIONS | set(REFUSED)]
    assert not unplaced, f"vLLM arguments tito neither passes on, serves nor refuses: {unplaced}"
    assert set(REFUSED_ARGV) == set(REFUSED)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_argument_exits_2_naming_it(name: str, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(model_dir), *REFUSED_ARGV[name]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    flag = REFUSED_ARGV[name][0].replace("--no-", "--")
    assert len(err) == 1 and err[0].startswith(f"tito: {flag} is not supported by tito: "), err


@pytest.mark.parametrize(("argv", "words"), [
    (["--api-server-count", "0"], "--api-server-count 0 is not supported by tito: tito is an API server"),
    (["--worker-extension-cls", "my.ext.Extension"], "--worker-extension-cls my.ext.Extension is not supported"),
    (["--num-kv-blocks", "8", "--num-gpu-blocks-override", "8"], "--num-kv-blocks is a shorthand for part of"),
    (["--kv-events-port", "5557", "--kv-events-config", '{"enable_kv_cache_events": true}'], "give one of them"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    (["--tool-call-parser", "no-such-parser"], "'no-such-parser' is not a tool parser vLLM knows"),
    (["--additional-config", '{"fp32_lm_head": true}', "--hf-overrides", '{"head_dtype": "bfloat16"}'],
     "fp32_lm_head asks for an fp32 LM head"),
    (["--max-model-len", "lots"], "argument --max-model-len"),
    (["--lora-modules", "a=/tmp/adapter"], "--lora-modules needs --enable-lora"),
])
def test_bad_combinations_exit_2(argv: list[str], words: str, model_dir: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) if argv[0] == "--max-model-len" else _nothing():
        assert main(["serve", "--model", str(model_dir), *argv]) == 2
    assert words in capsys.readouterr().err


class _nothing:  # noqa: N801 - a context manager that lets everything through
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_prime_rl_defaults_parse_into_engine_and_front_end(model_dir: Path) -> None:
    s = parse_serve([str(model_dir), "--tool-call-parser", "hermes", "--data-parallel-rpc-port", "13345",
                     "--api-server-count", "1", "--all2all-backend", "allgather_reducescatter",
                     "--enable-auto-tool-choice", "--logprobs-mode", "processed_logprobs", "--additional-config",
                     '{"fp32_lm_head": true, "fp32_router_logits": true}', "--max_model_len", "1k", "-tp", "1",
                     "--no-enable-prefix-caching", "--served-model-name", "Qwen/Qwen3-0.6B", "qwen"], env={})
    assert s.model == str(model_dir) and s.model_name == "Qwen/Qwen3-0.6B" and s.max_model_len == 1000
    assert s.enable_prefix_caching is False and s.tensor_parallel_size == 1
    engine = engine_options(s)
    assert engine["logprobs_mode"] == "processed_logprobs" and engine["data_parallel_rpc_port"] == 13345
    assert engine["hf_overrides"] == {"head_dtype": "float32"}  # Prime-RL's fp32_lm_head is vLLM's head_dtype
    front = frontend_options(s)
    assert front.tool_call_parser == "hermes" and front.enable_auto_tool_choice is True
    assert front.response_role == "assistant"  # vLLM's default where nothing was given


def test_one_argument_for_what_tito_and_vllm_both_name(model_dir: Path) -> None:
    """`--max-logprobs` is vLLM's argument, read into tito's settings; its TITO_ variable still works, the command
    line wins; tito's `--log-level info` still parses (vLLM's choices are upper case) and reaches vLLM's logging."""
    assert parse_serve([], env={"TITO_MAX_LOGPROBS": "5"}).max_logprobs == 5
    assert parse_serve(["--max-logprobs", "7"], env={"TITO_MAX_LOGPROBS": "5"}).max_logprobs == 7
    s = parse_serve(["--log-level", "debug"], env={})
    assert s.log_level == "DEBUG" and s.vllm_args["log_level"] == "DEBUG" and "log_level" in engine_options(s)
    parser = serve_parser()
    assert sum(1 for a in parser._actions if "--max-logprobs" in a.option_strings) == 1
    with pytest.raises(ServeArgsError, match="the model is given twice"):
        parse_serve([str(model_dir), "--model", "/elsewhere"], env={})


def test_several_api_keys_as_vllm_takes_them() -> None:
    s = parse_serve(["--api-key", "k1", "k2"], env={})
    assert s.api_key == ["k1", "k2"]
    keys = Keys.from_settings(s)
    assert keys.data is not None and len(keys.data) == 2 and keys.admin == keys.data
    assert Keys.from_settings(parse_serve([], env={"TITO_API_KEY": "only"})).data is not None


def test_trainer_worker_extension_is_left_to_tito() -> None:
    s = parse_serve(["--worker-extension-cls", "areal.engine.vllm_ext.vllm_worker_extension.VLLMWorkerExtension"],
                    env={})
    from app.engine.vllm_args import notices, refusals

    assert refusals(s) == []
    assert any("not loaded" in line for line in notices(s))


def test_a_launcher_namespace_round_trips_through_its_command_line() -> None:
    """``namespace_argv``: what a launcher hands vLLM's parser as a namespace comes back the same from the command
    line (booleans both ways, JSON, lists); what vLLM's parser does not know is left out."""
    from app.engine.vllm_args import namespace_argv, parse_given

    values = {"model": "m", "max_model_len": 512, "enforce_eager": False, "enable_auto_tool_choice": True,
              "served_model_name": ["a", "b"], "additional_config": {"fp32_lm_head": True}, "host": None,
              "enable_prefix_caching": False, "liveness_timeout_seconds": 30.0, "logprobs_mode": "processed_logprobs"}
    argv = namespace_argv(values)
    assert "--liveness-timeout-seconds" not in argv and "--host" not in argv
    given = parse_given(argv)
    assert given == {k: v for k, v in values.items() if v is not None and k != "liveness_timeout_seconds"}
