"""Security and hostile input: API keys per plane, the weight-path allow-list, request limits, safe unpickling,
errors that leak nothing. Fast tests run the real app (real route table and middleware, no engine); the end-to-end
tests run one real server started with both keys."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from app.core.protocol import ApiError, GenerateRequest
from app.core.settings import Settings
from app.engine.safe_pickle import UnsafePickleError, restricted_loads
from app.engine.sampling import Limits, build_sampling_params, check_prompt, configured_limits, min_tokens_refusal
from app.main import create_app
from app.server.security import Keys, Plane, classify
from app.weights.paths import allowed_roots, resolve_allowed
from tests.conftest import ADMIN_KEY, DATA_KEY, KEYED_MAX_MODEL_LEN
from tests.helpers import ServerProcess, restore_server

GEN = "/inference/v1/generate"
OK_GEN = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "temperature": 0}}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def app_with(**settings: Any) -> TestClient:
    """The real app (every router, every middleware) without starting an engine: routes that need the engine
    answer 503 "server is starting", which is enough to see whether the key check let the request through."""
    return TestClient(create_app(Settings.build(env={}, **settings)), raise_server_exceptions=False)


def assert_401(r: httpx.Response, words: str | None = None) -> None:
    assert r.status_code == 401, (r.status_code, r.text)
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 401
    assert err["type"] == "UnauthorizedError"
    assert DATA_KEY not in r.text and ADMIN_KEY not in r.text
    if words:
        assert words in err["message"], err["message"]


# --------------------------------------------------------------------------------------------------- planes


@pytest.mark.parametrize("path,plane", [
    ("/health", Plane.OPEN), ("/liveness", Plane.OPEN), ("/ready", Plane.OPEN), ("/version", Plane.OPEN),
    ("/metrics", Plane.OPEN), ("/openapi.json", Plane.OPEN), ("/docs", Plane.OPEN), ("/redoc", Plane.OPEN),
    (GEN, Plane.DATA), ("/v1/models", Plane.DATA), ("/v1/lora_adapters", Plane.ADMIN),
    ("/v1/load_lora_adapter", Plane.ADMIN), ("/v1/load_lora_adapter/", Plane.ADMIN),
    ("/v1/unload_lora_adapter", Plane.ADMIN), ("/inference/v1/abort_requests", Plane.ADMIN),
    ("/load_lora_adapter", Plane.ADMIN), ("/pause", Plane.ADMIN), ("/resume", Plane.ADMIN),
    ("/update_weights", Plane.ADMIN), ("/init_broadcaster", Plane.ADMIN), ("/drain", Plane.ADMIN),
    ("/abort_requests", Plane.ADMIN), ("/sleep", Plane.ADMIN), ("/some_route_added_later", Plane.ADMIN),
    ("/v1", Plane.ADMIN), ("/inference", Plane.ADMIN), ("/healthz", Plane.ADMIN), ("/health/", Plane.ADMIN),
    ("", Plane.ADMIN),
])
def test_classify_is_default_deny(path, plane):
    assert classify(path) is plane


def test_protect_metrics_moves_metrics_to_the_data_plane():
    assert classify("/metrics", protect_metrics=True) is Plane.DATA


ADMIN_WORDS = ("pause", "resume", "weight", "broadcast", "load_lora", "unload_lora", "drain", "abort", "sleep",
               "wake", "reset", "collective", "shutdown", "transfer", "stage", "commit")


def test_every_mounted_route_has_the_intended_plane():
    """Guard for routes other issues add: anything that changes state is admin, whatever its prefix."""
    app = create_app(Settings.build(env={}))
    paths = {r.path for r in app.routes if hasattr(r, "path")}
    assert {"/inference/v1/generate", "/pause", "/update_weights", "/load_lora_adapter"} <= paths
    for path in paths:
        plane = classify(path)
        if any(w in path for w in ADMIN_WORDS) and path != "/drain_status":
            assert plane is Plane.ADMIN, path
        if plane is Plane.OPEN:
            assert path in {"/health", "/liveness", "/ready", "/version", "/metrics", "/openapi.json", "/docs",
                            "/docs/oauth2-redirect", "/redoc"}, path


def test_keys_empty_means_none():
    assert not Keys.of(None, None).any
    assert not Keys.of("EMPTY", "").any
    k = Keys.of("a", None)
    assert k.data == k.admin and not k.admin_is_separate
    k = Keys.of(None, "b")
    assert k.data is None and k.admin is not None


# --------------------------------------------------------------------------------------------------- key rules


@pytest.fixture(scope="module")
def both() -> TestClient:
    return app_with(api_key=DATA_KEY, admin_api_key=ADMIN_KEY)


def test_data_route_missing_wrong_and_right_key(both):
    assert_401(both.post(GEN, json=OK_GEN), "Authorization: Bearer")
    assert_401(both.post(GEN, json=OK_GEN, headers=bearer("nope")), "invalid API key")
    assert_401(both.post(GEN, json=OK_GEN, headers=bearer("EMPTY")), "invalid API key")
    assert_401(both.post(GEN, json=OK_GEN, headers={"Authorization": DATA_KEY}))  # no scheme
    assert_401(both.post(GEN, json=OK_GEN, headers={"Authorization": f"Basic {DATA_KEY}"}))
    assert_401(both.post(GEN, json=OK_GEN, headers=bearer(DATA_KEY + "x")))
    assert_401(both.post(GEN, json=OK_GEN, headers=bearer(DATA_KEY[:-1])))
    assert_401(both.get("/v1/models"))
    for headers in (bearer(DATA_KEY), bearer(ADMIN_KEY), {"Authorization": f"bearer  {DATA_KEY} "}):
        r = both.post(GEN, json=OK_GEN, headers=headers)
        assert r.status_code == 503 and "starting" in r.text, r.text  # past the key check, no engine here
        assert both.get("/v1/models", headers=headers).status_code == 503


@pytest.mark.parametrize("method,path", [
    ("POST", "/pause"), ("POST", "/resume"), ("POST", "/update_weights"), ("POST", "/reload_weights"),
    ("POST", "/init_broadcaster"), ("POST", "/load_lora_adapter"), ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"), ("POST", "/drain"), ("DELETE", "/drain"), ("POST", "/abort_requests"),
    ("POST", "/inference/v1/abort_requests"), ("GET", "/is_paused"), ("POST", "/update_weight_version"),
    ("POST", "/stage"), ("POST", "/stage_chunk"), ("POST", "/stage_stream_init"), ("POST", "/stage_stream_chunk"),
    ("POST", "/commit"), ("GET", "/weight_status"),
])
def test_admin_route_needs_the_admin_key(both, method, path):
    body = {"lora_name": "a", "lora_path": "/tmp"} if "lora" in path else {}
    assert_401(both.request(method, path, json=body), "Authorization: Bearer")
    assert_401(both.request(method, path, json=body, headers=bearer("wrong")), "invalid API key")
    assert_401(both.request(method, path, json=body, headers=bearer(DATA_KEY)), "data-plane API key does not open")
    r = both.request(method, path, json=body, headers=bearer(ADMIN_KEY))
    assert r.status_code != 401, r.text


def test_unknown_routes_are_admin_so_404_needs_a_key(both):
    assert_401(both.get("/no/such/route"))
    assert_401(both.get("/no/such/route", headers=bearer(DATA_KEY)))
    assert both.get("/no/such/route", headers=bearer(ADMIN_KEY)).status_code == 404


def test_encoded_and_slashed_admin_paths_stay_admin(both):
    for path in ("/v1/load%5Flora_adapter", "/v1/load_lora_adapter/", "/inference/v1/abort%5Frequests"):
        assert_401(both.post(path, json={}, headers=bearer(DATA_KEY)))


def test_open_routes_need_no_key(both):
    assert both.get("/version").status_code == 200
    assert both.get("/openapi.json").status_code == 200
    assert both.get("/docs").status_code == 200
    for path in ("/health", "/liveness", "/ready", "/metrics"):
        assert both.get(path).status_code != 401, path


def test_protect_metrics():
    c = app_with(api_key=DATA_KEY, admin_api_key=ADMIN_KEY, protect_metrics=True)
    assert_401(c.get("/metrics"))
    assert c.get("/metrics", headers=bearer(DATA_KEY)).status_code != 401
    assert c.get("/health").status_code != 401


def test_only_api_key_guards_both_planes_with_that_key():
    c = app_with(api_key=DATA_KEY)
    assert_401(c.post("/pause"))
    assert_401(c.post(GEN, json=OK_GEN))
    assert c.post("/pause", headers=bearer(DATA_KEY)).status_code != 401
    assert c.post(GEN, json=OK_GEN, headers=bearer(DATA_KEY)).status_code != 401


def test_only_admin_key_leaves_the_data_plane_open():
    c = app_with(admin_api_key=ADMIN_KEY)
    assert c.post(GEN, json=OK_GEN).status_code != 401
    assert_401(c.post("/pause"))
    assert c.post("/pause", headers=bearer(ADMIN_KEY)).status_code != 401


@pytest.mark.parametrize("key", [None, "", "EMPTY"])
def test_no_key_configured_means_open(key):
    c = app_with(api_key=key, admin_api_key=key)
    assert c.post("/pause").status_code != 401
    assert c.post(GEN, json=OK_GEN, headers=bearer("anything")).status_code != 401


def test_keys_come_from_the_environment_and_stay_out_of_repr():
    s = Settings.build(env={"TITO_API_KEY": DATA_KEY, "TITO_ADMIN_API_KEY": ADMIN_KEY})
    assert (s.api_key, s.admin_api_key) == (DATA_KEY, ADMIN_KEY)
    assert DATA_KEY not in repr(s) and ADMIN_KEY not in repr(s)
    c = TestClient(create_app(s))
    assert_401(c.post("/pause", headers=bearer(DATA_KEY)))


def test_unauthenticated_body_is_refused_before_it_is_read(both):
    # 401, not 413: a caller without a key gets nothing past the key check, not even the body limit.
    r = both.post(GEN, content=b"x" * (9 * 1024 * 1024), headers={"Content-Type": "application/json"})
    assert_401(r)


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
    ({"max_tokens": 63}, "sampling_params.max_tokens"),
])
def test_each_count_limit_is_a_400_naming_the_field(sp, param):
    with pytest.raises(ApiError) as e:
        build_sampling_params(_sp(**sp), LIMITS)
    assert e.value.status == 400 and e.value.param == param, e.value.message


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


class _Evil:
    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


def _malicious(marker: Path) -> list[tuple[str, bytes]]:
    import subprocess

    import torch

    cmd = f"touch {marker}"
    meta_ok = {torch.float32: [("w", torch.Size([2]), 2)]}
    return [
        ("os.system", pickle.dumps(_Evil(os.system, cmd))),
        ("subprocess", pickle.dumps(_Evil(subprocess.call, ["touch", str(marker)]))),
        ("eval", pickle.dumps(_Evil(eval, f"open({str(marker)!r}, 'w')"))),
        ("exec protocol 0", pickle.dumps(_Evil(exec, f"open({str(marker)!r}, 'w')"), protocol=0)),
        ("stack_global builtins", _stack_global("builtins", "exec", f"open({str(marker)!r}, 'w')")),
        ("torch function", _stack_global("torch", "load", str(marker))),
        ("torch submodule", _stack_global("torch.serialization", "load", str(marker))),
        ("INST opcode", b"(S'" + cmd.encode() + b"'\nios\nsystem\n."),
        ("OBJ opcode", b"\x80\x02(cos\nsystem\nS'" + cmd.encode() + b"'\no."),
        ("nested in real metadata", pickle.dumps({**meta_ok, torch.bfloat16: [_Evil(os.system, cmd)]})),
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
    pickle.loads(pickle.dumps(_Evil(os.system, f"touch {marker}")))
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


# =================================================================================================== end to end


@pytest.fixture(scope="module")
def secured(keyed_tito: ServerProcess) -> Iterator[ServerProcess]:
    """The shared keyed server: both keys (from the environment, as a deployment would pass them), LoRA, and small
    request caps (max_model_len 128, 4 sequences, 5 logprobs, 4 stop token ids, 2 logit biases, 64 KiB bodies; see
    conftest.py). Put back at the module's end (test_e2e_malicious_broadcast_metadata_runs_nothing leaves a broadcast
    group)."""
    yield keyed_tito
    restore_server(keyed_tito.url, drop_broadcaster=True, headers=bearer(ADMIN_KEY))


@pytest.fixture(scope="module")
def data(secured: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=secured.url, timeout=60.0, headers=bearer(DATA_KEY)) as c:
        yield c


@pytest.fixture(scope="module")
def admin(secured: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=secured.url, timeout=60.0, headers=bearer(ADMIN_KEY)) as c:
        yield c


@pytest.fixture(scope="module")
def outside() -> Iterator[Path]:
    """A directory outside every allowed root (the server's roots are the pytest temp tree)."""
    d = Path(tempfile.mkdtemp(prefix="tito-outside-"))
    (d / "adapter_config.json").write_text('{"r": 8, "peft_type": "LORA"}')
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_e2e_key_rules(secured, data, admin):
    url = secured.url
    assert_401(httpx.post(url + GEN, json=OK_GEN, timeout=30))
    assert_401(httpx.post(url + GEN, json=OK_GEN, headers=bearer("wrong"), timeout=30))
    assert data.post(GEN, json=OK_GEN).status_code == 200
    assert admin.post(GEN, json=OK_GEN).status_code == 200
    assert data.get("/v1/models").json()["data"][0]["max_model_len"] == KEYED_MAX_MODEL_LEN == 128
    # The data key never opens an admin route, and the refused call did nothing.
    assert_401(data.post("/pause"), "data-plane API key does not open")
    assert_401(httpx.post(url + "/pause", timeout=30))
    assert admin.get("/is_paused").json()["is_paused"] is False
    assert_401(data.post("/abort_requests", json={}))
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(url + path, timeout=30).status_code == 200, path


def test_e2e_admin_key_opens_admin_routes(admin, data):
    assert admin.post("/pause", params={"mode": "keep"}).status_code == 200
    try:
        assert admin.get("/is_paused").json()["is_paused"] is True
    finally:
        assert admin.post("/resume").status_code == 200
    assert data.post(GEN, json=OK_GEN).status_code == 200


def _escapes(root: Path, outside: Path) -> list[tuple[str, str]]:
    link = root / "sec-link-out"
    if not link.is_symlink():
        link.symlink_to(outside)
    rel = os.path.relpath(outside, root)
    return [("dotdot", str(root / rel)), ("absolute", str(outside)), ("etc", "/etc"), ("symlink", str(link)),
            ("symlink child", str(link / "sub"))]


@pytest.mark.parametrize("route,field", [("/update_weights", "weight_dir"), ("/load_lora_adapter", "lora_path"),
                                         ("/v1/load_lora_adapter", "lora_path")])
def test_e2e_path_escapes_are_403(admin, data, tmp_path_factory, outside, route, field):
    root = tmp_path_factory.getbasetemp()
    for what, path in _escapes(root, outside):
        body = {field: path, "lora_name": "sec-escape"}
        r = admin.post(route, json=body)
        assert r.status_code == 403, (what, r.text)
        err = r.json()["error"]
        assert err["param"] == field and err["type"] == "PermissionDeniedError"
        assert "LORA" not in r.text  # nothing read from the outside directory
    # Inside the roots the allow-list lets it through (here to "does not exist"/"not an adapter", not 403).
    r = admin.post(route, json={field: str(root / "sec-missing"), "lora_name": "sec-escape"})
    assert r.status_code in (400, 404), r.text
    assert data.post(GEN, json=OK_GEN).status_code == 200


def test_e2e_errors_do_not_echo_file_contents(admin, tmp_path_factory):
    d = tmp_path_factory.mktemp("sec-bad-ckpt")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{SECRET-WEIGHTS-1}" + b"\x00" * 64)
    (d / "adapter_config.json").write_text("SECRET-CONFIG-2 {not json")
    (d / "adapter_model.safetensors").write_bytes(b"SECRET-ADAPTER-3" * 8)
    for route, body in (("/update_weights", {"weight_dir": str(d)}),
                        ("/load_lora_adapter", {"lora_name": "sec-bad", "lora_path": str(d)})):
        r = admin.post(route, json=body)
        assert 400 <= r.status_code < 500, r.text
        assert "SECRET" not in r.text and "Traceback" not in r.text, r.text


def test_e2e_limits(secured, data):
    def gen(**kw: Any) -> httpx.Response:
        return data.post(GEN, json={"token_ids": kw.pop("token_ids", [1, 2, 3]), "sampling_params": kw})

    for kw, param in (({"n": 5}, "sampling_params.n"), ({"logprobs": 6}, "sampling_params.logprobs"),
                      ({"prompt_logprobs": 6}, "sampling_params.prompt_logprobs"),
                      ({"stop_token_ids": [1, 2, 3, 4, 5]}, "sampling_params.stop_token_ids"),
                      ({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "sampling_params.logit_bias"),
                      ({"token_ids": [1] * 128}, "token_ids")):
        r = gen(**kw)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (kw, r.text)
    assert gen(n=4, logprobs=5, stop_token_ids=[1, 2, 3, 4], logit_bias={"1": 1, "2": 1}, max_tokens=2,
               token_ids=[1] * 100).status_code == 200
    big = b'{"token_ids": [' + b"1, " * 30000 + b'1]}'
    r = data.post(GEN, content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    r = data.post(GEN, content=iter([big[i:i + 8192] for i in range(0, len(big), 8192)]),
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert data.post(GEN, json=OK_GEN).status_code == 200


def test_e2e_malicious_broadcast_metadata_runs_nothing(secured, admin, data, tmp_path):
    """Be the trainer of a real broadcast group (gloo, loopback) and send a pickle that would run a command."""
    import torch
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    from tests.helpers import free_port

    marker = tmp_path / "pwned-by-broadcast"
    port = free_port()
    box: dict[str, Any] = {}

    def trainer_join() -> None:
        try:
            box["pg"] = stateless_init_torch_distributed_process_group("127.0.0.1", port, 0, 2, "gloo")
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            box["err"] = e

    t = threading.Thread(target=trainer_join, daemon=True)
    t.start()
    r = admin.post("/init_broadcaster", json={"host": "127.0.0.1", "port": port, "rank_offset": 0,
                                              "inference_world_size": 1, "timeout": 60})
    t.join(60)
    assert r.status_code == 200 and "pg" in box, (r.text, box.get("err"))
    pg = box["pg"]

    def bcast(tensor: torch.Tensor) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        pg.broadcast([tensor], opts).wait()

    payload = pickle.dumps(_Evil(os.system, f"touch {marker}"))
    box2: dict[str, Any] = {}

    def update() -> None:
        box2["r"] = admin.post("/update_weights", json={"weight_dir": None, "timeout": 60}, timeout=120)

    u = threading.Thread(target=update, daemon=True)
    u.start()
    try:
        bcast(torch.tensor([1], dtype=torch.int64))
        bcast(torch.tensor([len(payload)], dtype=torch.int64))
        bcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    finally:
        u.join(120)
    r = box2["r"]
    assert r.status_code == 400, r.text
    assert "posix.system" in r.text or "os.system" in r.text, r.text
    assert not marker.exists()
    assert data.post(GEN, json=OK_GEN).status_code == 200
    if hasattr(pg, "shutdown"):
        pg.shutdown()


# A tiny app is also enough to show the middleware needs nothing else from tito.
def test_middleware_is_standalone():
    from app.server.security import ApiKeyAuth

    app = FastAPI()

    @app.post("/pause")
    async def pause() -> dict[str, str]:
        return {"status": "paused"}

    app.add_middleware(ApiKeyAuth, keys=Keys.of(DATA_KEY, ADMIN_KEY))
    c = TestClient(app)
    assert_401(c.post("/pause", headers=bearer(DATA_KEY)))
    assert c.post("/pause", headers=bearer(ADMIN_KEY)).json() == {"status": "paused"}


HOSTILE_NUMBERS = [
    {"seed": 2**70}, {"seed": -1}, {"seed": -(2**70)}, {"top_k": 2**40}, {"top_k": -5}, {"temperature": 1e308},
    {"temperature": 1e-320}, {"top_p": 1e-320}, {"min_p": 1.0}, {"repetition_penalty": 1e308},
    {"presence_penalty": -1e308}, {"frequency_penalty": 1e308}, {"max_tokens": 2**63}, {"min_tokens": 2**63},
    {"min_tokens": 5, "max_tokens": 2}, {"logit_bias": {"1": 1e308, "2": -1e308}}, {"n": 2**63},
    {"logprobs": 2**63}, {"stream_interval": 0}, {"stream_interval": -1}, {"routed_experts_prompt_start": -1},
    {"extra_args": {"a": [[[[[1]]]]]}}, {"logprob_token_ids": [1] * 2000},
]
HOSTILE_RAW = [b'{"token_ids":[1,2],"sampling_params":{"temperature":NaN}}',
               b'{"token_ids":[1,2],"sampling_params":{"top_p":Infinity}}',
               b'{"token_ids":[1,2],"sampling_params":{"logit_bias":{"1":NaN}}}',
               b'{"token_ids":[1,2],"priority":99999999999999999999999}',
               b'{"token_ids":[' + b"[" * 5000 + b"]" * 5000 + b"]}",
               b'{"token_ids":[1],"sampling_params":{"extra_args":' + b'{"a":' * 3000 + b"1" + b"}" * 3001 + b"}"]


def test_e2e_hostile_numbers_get_4xx_or_a_clean_answer(data):
    """Values at the edge of every numeric type: each answer is < 500 and the engine keeps serving."""
    for sp in HOSTILE_NUMBERS:
        r = data.post(GEN, json={"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, **sp}}
                      if "max_tokens" not in sp else {"token_ids": [1, 2, 3], "sampling_params": sp})
        assert r.status_code < 500, (sp, r.text)
        if r.status_code >= 400:
            assert r.json()["error"]["code"] == r.status_code
    for raw in HOSTILE_RAW:
        r = data.post(GEN, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (raw[:80], r.text)
    r = data.post(GEN, json=OK_GEN)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2
