"""Hostile input refused before it reaches the engine (fast, no engine): the body limit, the request limits, values the
engine cannot carry, errors that leak no trace or file contents, safe unpickling of broadcast metadata, the
weight-path allow-list. The same on a real server: test_security_e2e.py."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from app.core.protocol import ApiError, GenerateRequest
from app.core.settings import Settings
from app.engine.safe_pickle import UnsafePickleError, restricted_loads
from app.engine.sampling import Limits, build_sampling_params, check_prompt, configured_limits, min_tokens_refusal
from app.weights.paths import allowed_roots, resolve_allowed
from tests.conftest import ADMIN_KEY
from tests.security_checks import (
    Evil,
    app_with,
    bearer,
)
from tito.main import create_app

# --------------------------------------------------------------------------------------------------- body limit


def test_body_over_limit_is_413_by_length_and_by_chunks():
    c = app_with(admin_api_key=ADMIN_KEY, max_body_bytes=1000)
    body = b'{"lora_name": "a", "lora_path": "' + b"p" * 2000 + b'"}'
    h = {**bearer(ADMIN_KEY), "Content-Type": "application/json"}
    r = c.post("/v1/load_lora_adapter", content=body, headers=h)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(body), 100):
            yield body[i:i + 100]

    # No Content-Length: counted while read. FastAPI turns other errors in body parsing into a 400; this stays 413.
    r = c.post("/v1/load_lora_adapter", content=chunks(), headers=h)
    assert r.status_code == 413 and "limit of 1000 bytes" in r.json()["error"]["message"], r.text


# --------------------------------------------------------------------------------------------------- limits


LIMITS = Limits(vocab_size=512, max_model_len=64, max_num_seqs=4, max_logprobs=5, priority_scheduling=False,
                max_logit_bias=2, max_stop_token_ids=3)


def _sp(**sp: Any) -> GenerateRequest:
    return GenerateRequest.model_validate({"token_ids": [1, 2], "sampling_params": sp})


@pytest.mark.parametrize("sp,param", [
    ({"n": 5}, "sampling_params.n"),
    ({"logprobs": 6}, "sampling_params.logprobs"),
    ({"logprobs": -1}, "sampling_params.logprobs"),
    ({"prompt_logprobs": 6}, "sampling_params.prompt_logprobs"),
    ({"stop_token_ids": [1, 2, 3, 4]}, "sampling_params.stop_token_ids"),
    ({"logit_bias": {"1": 1.0, "2": 1.0, "3": 1.0}}, "sampling_params.logit_bias"),
])
def test_each_count_limit_is_a_400_naming_the_field(sp, param):
    with pytest.raises(ApiError) as e:
        build_sampling_params(_sp(**sp), LIMITS)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_max_tokens_past_the_context_is_the_room_left():
    """As vLLM's token API: prompt + max_tokens past the context generates what fits (finish "length"), no 400."""
    assert build_sampling_params(_sp(max_tokens=63), LIMITS).max_tokens == 62


@pytest.mark.parametrize("sp,param", [
    ({"seed": 2**70}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"top_k": 2**64}, "top_k"),
    ({"stream_interval": 2**70}, "stream_interval"), ({"logit_bias": {"1": float("nan")}}, "logit_bias"),
    ({"logit_bias": {"1": float("-inf")}}, "logit_bias"),
])
def test_values_the_engine_cannot_carry_are_400(sp, param):
    # A seed beyond 64 bits reached vLLM's engine client and came back as a 500 (found by the hostile-number test).
    with pytest.raises(ApiError) as e:
        build_sampling_params(_sp(**sp), LIMITS)
    assert e.value.status == 400 and e.value.param == "sampling_params." + param, e.value.message
    build_sampling_params(_sp(seed=2**63 - 1, logit_bias={"1": 100.0}), LIMITS)


def test_limits_at_the_cap_pass():
    build_sampling_params(_sp(n=4, logprobs=5, prompt_logprobs=5, stop_token_ids=[1, 2, 3],
                              logit_bias={"1": 1.0, "2": -1.0}, max_tokens=62), LIMITS)


def test_prompt_length_limit():
    check_prompt([1] * 63, LIMITS)
    with pytest.raises(ApiError) as e:
        check_prompt([1] * 64, LIMITS)
    assert e.value.status == 400 and e.value.param == "token_ids"


def test_count_limits_are_flags():
    s = Settings.build(env={"TITO_MAX_STOP_TOKEN_IDS": "7"}, max_logit_bias=9)
    lim = configured_limits(LIMITS, s)
    assert (lim.max_stop_token_ids, lim.max_logit_bias) == (7, 9)
    assert Settings.build(env={}).max_stop_token_ids == 1024


def test_min_tokens_refused_where_an_eos_lies_outside_the_vocabulary():
    """A tokenizer eos past the model's ids killed the engine on min_tokens (vLLM masks it by index); such a server
    refuses min_tokens > 0 naming the ids, and configured_limits keeps the refusal."""
    lim = replace(LIMITS, min_tokens_refusal=min_tokens_refusal((512,), 512))
    assert not min_tokens_refusal((), 512)
    lim = configured_limits(lim, Settings.build(env={}))
    with pytest.raises(ApiError) as e:
        build_sampling_params(_sp(min_tokens=1, max_tokens=4), lim)
    assert e.value.status == 400 and e.value.param == "sampling_params.min_tokens" and "[512]" in e.value.message
    build_sampling_params(_sp(min_tokens=0, max_tokens=4), lim)
    build_sampling_params(_sp(min_tokens=3, max_tokens=4), LIMITS)


# --------------------------------------------------------------------------------------------------- errors


def test_unexpected_errors_leak_no_trace_or_file_contents(tmp_path):
    app = create_app(Settings.build(env={}))
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT")

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError(f"failed reading {secret}: {secret.read_text()}")

    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "internal error: RuntimeError", "type": "InternalServerError",
                                  "param": None, "code": 500}}
    assert "TOP-SECRET" not in r.text and str(tmp_path) not in r.text and "Traceback" not in r.text


# --------------------------------------------------------------------------------------------------- pickle


def _stack_global(module: str, name: str, arg: str) -> bytes:
    """Protocol-4 STACK_GLOBAL + REDUCE, hand-assembled (what pickle.dumps of a malicious __reduce__ makes)."""
    def s(x: str) -> bytes:
        b = x.encode()
        return b"\x8c" + bytes([len(b)]) + b

    return b"\x80\x04" + s(module) + s(name) + b"\x93" + s(arg) + b"\x85R."


def _malicious(marker: Path) -> list[tuple[str, bytes]]:
    import subprocess

    import torch

    cmd = f"touch {marker}"
    meta_ok = {torch.float32: [("w", torch.Size([2]), 2)]}
    return [
        ("os.system", pickle.dumps(Evil(os.system, cmd))),
        ("subprocess", pickle.dumps(Evil(subprocess.call, ["touch", str(marker)]))),
        ("eval", pickle.dumps(Evil(eval, f"open({str(marker)!r}, 'w')"))),
        ("exec protocol 0", pickle.dumps(Evil(exec, f"open({str(marker)!r}, 'w')"), protocol=0)),
        ("stack_global builtins", _stack_global("builtins", "exec", f"open({str(marker)!r}, 'w')")),
        ("torch function", _stack_global("torch", "load", str(marker))),
        ("torch submodule", _stack_global("torch.serialization", "load", str(marker))),
        ("INST opcode", b"(S'" + cmd.encode() + b"'\nios\nsystem\n."),
        ("OBJ opcode", b"\x80\x02(cos\nsystem\nS'" + cmd.encode() + b"'\no."),
        ("nested in real metadata", pickle.dumps({**meta_ok, torch.bfloat16: [Evil(os.system, cmd)]})),
        ("persistent id", b"\x80\x02P" + cmd.encode() + b"\n."),
        ("extension code", b"\x80\x02\x82\x01."),
    ]


def test_malicious_pickles_run_nothing(tmp_path):
    import copyreg

    marker = tmp_path / "pwned"
    copyreg.add_extension("os", "system", 1)  # make EXT1 code 1 name os.system, as a hostile peer would hope
    try:
        for name, payload in _malicious(marker):
            with pytest.raises(UnsafePickleError):
                restricted_loads(payload)
            assert not marker.exists(), name
    finally:
        copyreg.remove_extension("os", "system", 1)
    # The same bytes through plain pickle.loads would have run: the marker proves the payload was live.
    pickle.loads(pickle.dumps(Evil(os.system, f"touch {marker}")))
    assert marker.exists()


MALFORMED = [b"", b"\x80", b"\x80\x04\x95", b"not a pickle",
             b"\x80\x02ctorch\nfloat32\n}X\x03\x00\x00\x00fooK\x01sb.",  # BUILD state onto a dtype
             b"\x80\x02ctorch\nSize\nX\x01\x00\x00\x00a\x85R."]  # torch.Size("a")


@pytest.mark.parametrize("payload", MALFORMED)
def test_malformed_pickles_are_one_clean_error(payload):
    with pytest.raises(UnsafePickleError):
        restricted_loads(payload)


def test_broadcast_metadata_roundtrips_in_every_protocol():
    import torch

    meta = {torch.bfloat16: [("model.layers.0.mlp.up_proj.weight", torch.Size([256, 128]), 32768)],
            torch.float16: [("lm_head.weight", torch.Size([512, 128]), 65536)], torch.int8: []}
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        assert restricted_loads(pickle.dumps(meta, protocol=proto)) == meta
    with pytest.raises(UnsafePickleError, match="exceeds"):
        restricted_loads(b"\x80\x04N." + b"\x00" * 100, max_bytes=50)


# --------------------------------------------------------------------------------------------------- paths


def test_default_roots_never_include_the_filesystem_root(tmp_path, monkeypatch):
    monkeypatch.chdir("/")
    assert allowed_roots(Settings.build(env={}, model="/model")) == []
    with pytest.raises(ApiError) as e:
        resolve_allowed(Settings.build(env={}, model="/model"), "/etc", "weight_dir")
    assert e.value.status == 403
    monkeypatch.chdir(tmp_path)
    assert allowed_roots(Settings.build(env={}, model=str(tmp_path / "m" / "model"))) == [
        (tmp_path / "m").resolve(), tmp_path.resolve()]


def test_path_escapes_are_403(tmp_path, monkeypatch):
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    (tmp_path / "root2").mkdir()
    (root / "out").symlink_to(tmp_path / "root2")
    (root / "ok" / "deep").symlink_to("../../root2")
    s = Settings.build(env={}, allowed_weight_root=[str(root)])
    monkeypatch.chdir(root)
    assert resolve_allowed(s, "ok", "weight_dir") == (root / "ok").resolve()
    for bad in ("..", "../root2", "ok/../../root2", str(root) + "2", str(root / "out"), str(root / "ok" / "deep"),
                str(root / "out" / "x"), "/"):
        with pytest.raises(ApiError) as e:
            resolve_allowed(s, bad, "weight_dir")
        assert e.value.status == 403, bad
        assert e.value.message.count(str(tmp_path)) <= 1, e.value.message  # names the offending path only
    with pytest.raises(ApiError) as e:
        resolve_allowed(s, "ok\x00/x", "weight_dir")
    assert e.value.status == 400
