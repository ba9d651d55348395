"""The ``tito`` CLI as a user runs it: subprocesses, output checked. Help for every command; client commands against
real servers (read-only ones on the shared default server, state-changing ones on the shared LoRA server)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.client import TitoClient
from app.tiny.moe import make_tiny_moe
from tests.helpers import ROOT, ServerProcess, free_port, restore_server

COMMANDS = ["serve", "make-tiny-model", "generate", "status", "drain", "undrain", "update-weights", "load-lora",
            "unload-lora", "pause", "resume"]


def tito(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TITO_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "tito", *args], capture_output=True, text=True, cwd=ROOT,
                          env=full_env, timeout=timeout)


# The shared LoRA server also carries the opt-in --stream-interval (tested at the end), sparing an engine start.
STREAM_INTERVAL = 4


@pytest.fixture(scope="module")
def cli_server(lora_tito: ServerProcess) -> Iterator[ServerProcess]:
    """The session's shared LoRA server (``--enable-lora --max-lora-rank 8 --stream-interval 4``); put back at the
    end (this module updates its weights to a new version)."""
    yield lora_tito
    restore_server(lora_tito.url)


# ------------------------------------------------------------------------------------------------ no server


def test_every_command_has_help() -> None:
    top = tito("--help")
    assert top.returncode == 0
    for cmd in COMMANDS:
        assert cmd in top.stdout
        out = tito(cmd, "--help")
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"usage: tito {cmd}")
        # Every option carries a help text (argparse prints it under the option).
        assert "--help" in out.stdout and len(out.stdout.splitlines()) > 4


def test_serve_help_lists_every_flag_with_its_env_variable() -> None:
    """``tito serve --help=all``: tito's flags with their variables, and every argument of vLLM's own serve parser."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from app.core.settings import FLAGS

    out = " ".join(tito("serve", "--help=all").stdout.split())
    for f in FLAGS:
        assert f"{f.cli} " in out and f"env {f.env};" in out, f.name
    vllm = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    missing = [o for a in vllm._actions for o in a.option_strings if f"{o} " not in out and f"{o}," not in out]
    assert not missing, f"tito serve --help=all lacks vLLM's {missing}"
    # The first page names the groups, tito's among them (vLLM's collapsed help).
    page = tito("serve", "--help").stdout
    assert "tito " in page and "ModelConfig" in page, page


def test_serve_reads_flags_from_the_environment(tmp_path: Path) -> None:
    missing = tmp_path / "no-model-here"
    out = tito("serve", env={"TITO_MODEL": str(missing)})
    assert out.returncode == 2 and str(missing) in out.stderr and "make-tiny-model" in out.stderr
    # The flag wins over the environment.
    other = tmp_path / "flag-model"
    out = tito("serve", "--model", str(other), env={"TITO_MODEL": str(missing)})
    assert out.returncode == 2 and str(other) in out.stderr and str(missing) not in out.stderr


@pytest.mark.engine
def test_routed_experts_flag_is_refused_without_the_fix(tmp_path: Path) -> None:
    """On CPU the flag takes tito's fix to vLLM's CPU runner (served: tests/test_router_replay.py); without it
    (``TITO_VLLM_PATCHES=0``: vLLM 0.32 captures only in Model Runner V2) the start stops with the reason instead of
    serving ``routed_experts: null`` to a router-replay trainer. The other refusals (torch.compile, spawned engine
    processes, data parallel): tests/test_routed_experts_wire.py."""
    moe = make_tiny_moe(tmp_path / "moe")
    out = tito("serve", env={"TITO_MODEL": str(moe), "TITO_ENABLE_RETURN_ROUTED_EXPERTS": "true",
                             "TITO_VLLM_PATCHES": "0"}, timeout=180)
    assert out.returncode == 2, out.stderr
    assert "needs tito's fix to vLLM's CPU model runner" in out.stderr and "TITO_VLLM_PATCHES=0" in out.stderr


def test_make_tiny_model(tmp_path: Path) -> None:
    out = tito("make-tiny-model", str(tmp_path / "m"), timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"tiny model in {tmp_path / 'm'}"
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["vocab_size"] == 512 and (tmp_path / "m" / "model.safetensors").stat().st_size > 0


def test_make_tiny_model_writes_the_shape_asked_for(tmp_path: Path) -> None:
    """--shape qwen3-0.6b: Qwen3-0.6B's architecture (the seed's run and the benchmarks serve it), every tensor of
    that shape in bf16, the head tied (no lm_head.weight), a tokenizer beside it."""
    from safetensors import safe_open

    out = tito("make-tiny-model", str(tmp_path / "m"), "--shape", "qwen3-0.6b", timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"qwen3-0.6b-shaped model in {tmp_path / 'm'}"
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                                "torch_dtype")} == {
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16"}
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"} and "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == (151936, 1024)
    assert shapes["model.layers.27.self_attn.k_proj.weight"] == (8 * 128, 1024)
    assert shapes["model.layers.27.mlp.down_proj.weight"] == (1024, 3072)
    assert len(shapes) == 2 + 28 * 11
    assert (tmp_path / "m" / "tokenizer.json").is_file()


def test_client_commands_report_a_dead_server_clearly() -> None:
    out = tito("generate", "--tokens", "1,2", "--url", f"http://127.0.0.1:{free_port()}", "--timeout", "3")
    assert out.returncode == 1 and out.stderr.startswith("tito: POST /inference/v1/generate: no answer")
    out = tito("generate", "--tokens", "1,x")
    assert out.returncode == 1 and "comma-separated integers" in out.stderr


# ------------------------------------------------------------------------------------------------ shared server


@pytest.mark.engine
def test_generate_prints_the_tokens(tito_url: str) -> None:
    with TitoClient(tito_url) as c:
        want = c.generate([1, 2, 3], max_tokens=5, temperature=0, logprobs=1)
    out = tito("generate", "--tokens", "1,2,3", "--max-tokens", "5", "--temperature", "0", "--url", tito_url)
    assert out.returncode == 0, out.stderr
    assert out.stdout == " ".join(map(str, want.token_ids)) + "\n"
    assert "finish_reason=length tokens=5" in out.stderr

    out = tito("generate", "--tokens", "1,2,3", "--max-tokens", "5", "--temperature", "0", "--stream",
               "--url", tito_url)
    assert out.returncode == 0, out.stderr
    assert out.stdout == " ".join(map(str, want.token_ids)) + "\n"

    out = tito("generate", "--tokens", "1, 2, 3", "--max-tokens", "5", "--temperature", "0", "--logprobs",
               "--url", tito_url)
    rows = [ln.split("\t") for ln in out.stdout.splitlines()]
    assert [int(r[0]) for r in rows] == want.token_ids
    assert [float(r[1]) for r in rows] == pytest.approx(want.logprobs, abs=1e-5)

    out = tito("generate", "--tokens", "1,2,3", "--max-tokens", "2", "--json", env={"TITO_URL": tito_url})
    assert json.loads(out.stdout)["request_id"].startswith("generate-tokens-")


@pytest.mark.engine
def test_generate_shows_the_server_error(tito_url: str) -> None:
    out = tito("generate", "--tokens", "100000", "--url", tito_url)
    assert out.returncode == 1 and "400" in out.stderr and "100000" in out.stderr


@pytest.mark.engine
def test_status_summarizes_server_info(tito_url: str, tiny_model: Path) -> None:
    out = tito("status", "--url", tito_url)
    assert out.returncode == 0, out.stderr
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.stdout.splitlines())
    assert fields["model"] == str(tiny_model)
    assert fields["state"] == "serving"
    assert fields["weight version"] == "default"
    assert fields["in flight"] == "0"
    assert fields["adapters"] == "none"
    raw = json.loads(tito("status", "--json", "--url", tito_url).stdout)
    assert raw["state"]["ready"] is True
    # Nothing committed before this server's start: the model's own weights, and where updates would be recorded.
    state_dir = raw["state"]["weight_record"]["state_dir"]
    assert fields["weights from"] == f"the model directory at start (weight record: {state_dir})"


@pytest.mark.engine
def test_status_into_a_closed_pipe_ends_quietly(tito_url: str) -> None:
    """``tito status | head``: the reader is gone before tito writes; no BrokenPipeError traceback, SIGPIPE's 141."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TITO_")}
    p = subprocess.Popen([sys.executable, "-m", "tito", "status", "--json", "--url", tito_url], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # the reader leaves at once
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert err == ""


# ------------------------------------------------------------------------------------------------ own server


@pytest.mark.engine
def test_drain_and_undrain(cli_server: ServerProcess) -> None:
    url = cli_server.url
    try:
        out = tito("drain", "--drain-timeout", "10", "--url", url)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("drained in ") and '"still_running": 0' in out.stdout
        assert "draining" in out.stderr  # the progress line
        refused = tito("generate", "--tokens", "1,2", "--max-tokens", "1", "--url", url)
        assert refused.returncode == 1 and "503" in refused.stderr and "draining" in refused.stderr
        assert "draining" in tito("status", "--url", url).stdout
    finally:
        out = tito("undrain", "--url", url)
    assert out.returncode == 0 and out.stdout.startswith("undrain: ") and '"draining": false' in out.stdout
    assert tito("generate", "--tokens", "1,2", "--max-tokens", "1", "--url", url).returncode == 0


@pytest.mark.engine
def test_update_weights_shows_progress_and_time(cli_server: ServerProcess, tiny_model: Path) -> None:
    out = tito("update-weights", str(tiny_model), "--weight-version", "cli-v1", "--url", cli_server.url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"weights updated from {tiny_model} in ")
    assert json.loads(out.stdout.split(": ", 1)[1])["weight_version"] == "cli-v1"
    assert f"updating weights from {tiny_model} ..." in out.stderr
    assert "cli-v1" in tito("status", "--url", cli_server.url).stdout
    bad = tito("update-weights", "/etc", "--url", cli_server.url)
    assert bad.returncode == 1 and "403" in bad.stderr


@pytest.mark.engine
def test_load_and_unload_lora(cli_server: ServerProcess, tmp_path: Path) -> None:
    from tests.test_client import _write_adapter

    path = _write_adapter(tmp_path / "adapter", 3)
    out = tito("load-lora", "cli-lora", str(path), "--url", cli_server.url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"adapter cli-lora loaded from {path} in ")
    try:
        assert "cli-lora" in tito("status", "--url", cli_server.url).stdout
        gen = tito("generate", "--tokens", "1,2,3", "--max-tokens", "2", "--model", "cli-lora", "--url",
                   cli_server.url)
        assert gen.returncode == 0 and len(gen.stdout.split()) == 2
    finally:
        out = tito("unload-lora", "cli-lora", "--url", cli_server.url)
    assert out.returncode == 0 and "removed successfully" in out.stdout
    assert "adapters        none" in tito("status", "--url", cli_server.url).stdout


@pytest.mark.engine
def test_pause_and_resume(cli_server: ServerProcess) -> None:
    try:
        out = tito("pause", "--url", cli_server.url)
        assert out.returncode == 0 and out.stdout.startswith("paused in ") and '"paused"' in out.stdout
        assert "paused" in tito("status", "--url", cli_server.url).stdout
    finally:
        out = tito("resume", "--url", cli_server.url)
    assert out.returncode == 0 and out.stdout.startswith("resumed: ")
    assert "serving" in tito("status", "--url", cli_server.url).stdout


def _stream_choices(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The choice of every SSE event of one streamed request (n=1)."""
    with httpx.Client(base_url=url, timeout=120.0) as c, c.stream("POST", "/inference/v1/generate",
                                                                  json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:])["choices"][0] for ln in lines[:-1]]


@pytest.mark.engine
def test_stream_interval_sends_fewer_larger_events_with_the_same_tokens(cli_server: ServerProcess,
                                                                        tito_url: str) -> None:
    m, n = 25, STREAM_INTERVAL
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": m, "temperature": 0, "ignore_eos": True,
                                                        "logprobs": 1}}
    chunks = _stream_choices(cli_server.url, body)
    tokens = [t for ch in chunks for t in ch["token_ids"]]
    logprobs = [e["logprob"] for ch in chunks for e in ch["logprobs"]["content"]]
    sizes = [len(ch["token_ids"]) for ch in chunks]
    # The first token comes at once, then one event per n tokens (or more when the client reads late), the rest last.
    assert len(chunks) <= 1 + -(-(m - 1) // n), sizes
    assert all(s >= n for s in sizes[1:-1]), sizes
    assert chunks[-1]["finish_reason"] == "length"
    # The same tokens and logprobs as the JSON answer of this server and the default server's (interval 1) stream.
    with httpx.Client(base_url=cli_server.url, timeout=120.0) as c:
        whole = c.post("/inference/v1/generate", json=body).json()["choices"][0]
    assert tokens == whole["token_ids"] and len(tokens) == m
    assert logprobs == pytest.approx([e["logprob"] for e in whole["logprobs"]["content"]], abs=1e-5)
    default = _stream_choices(tito_url, body)
    assert [t for ch in default for t in ch["token_ids"]] == tokens


@pytest.mark.engine
def test_what_vllm_cannot_run_here_stops_the_start_with_its_own_reason(tiny_model: Path) -> None:
    """An engine argument this platform cannot run gets vLLM's own refusal in one line, exit 2, before anything
    starts (sampling masks need vLLM's GPU model runner)."""
    out = tito("serve", "--model", str(tiny_model), "--return-sampling-mask", timeout=180)
    assert out.returncode == 2, out.stderr
    line = "tito: vLLM refuses the engine arguments: sampling distribution replay requires Model Runner V2"
    assert line in out.stderr.splitlines(), out.stderr
