"""app.client against real servers: every method, typed results, streaming, errors, retries, auth, request logs.

Read-only calls use the shared session server. State-changing calls (pause, drain, weights, LoRA, broadcaster) use
the shared keyed server (``keyed_tito``: API keys, LoRA, JSON request logging); each test restores what it changed,
and the module puts back what tests leave (weight version, broadcast group).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from app.client import AsyncTitoClient, GenerateResult, StreamDelta, TitoClient, TitoError
from tests.conftest import ADMIN_KEY, DATA_KEY, KEYED_MAX_MODEL_LEN
from tests.helpers import ROOT, ServerProcess, free_port, metric_value, restore_server

PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def admin_server(keyed_tito: ServerProcess) -> Iterator[ServerProcess]:
    """The shared keyed server (both API keys, LoRA, JSON request logs), put back at the module's end: base weights,
    no broadcast group (test_init_broadcaster_joins_a_trainer_group leaves one)."""
    yield keyed_tito
    restore_server(keyed_tito.url, drop_broadcaster=True, headers={"Authorization": f"Bearer {ADMIN_KEY}"})


@pytest.fixture
def admin(admin_server: ServerProcess) -> Iterator[TitoClient]:
    with TitoClient(admin_server.url, api_key=DATA_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
        yield c


@pytest.fixture
def tc(tito_url: str) -> Iterator[TitoClient]:
    with TitoClient(tito_url, timeout=120) as c:
        yield c


# ------------------------------------------------------------------------------------------------ no server


def test_importing_the_client_loads_neither_vllm_nor_torch() -> None:
    code = ("import sys, app.client; heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('vllm', 'torch', 'transformers', 'fastapi', 'starlette')); print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _counting(status: int, seen: list[str]) -> httpx.MockTransport:
    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req.url.path)
        return httpx.Response(status, json={"error": {"message": "upstream", "type": "BadGateway", "param": None,
                                                      "code": status}})

    return httpx.MockTransport(handler)


def test_retries_only_idempotent_calls_on_gateway_errors() -> None:
    seen: list[str] = []
    with TitoClient("http://x", transport=_counting(502, seen), retries=2, backoff=0.001) as c:
        with pytest.raises(TitoError) as e:
            c.health()
        assert e.value.status == 502 and e.value.type == "BadGateway" and e.value.message == "upstream"
        assert seen == ["/health"] * 3
        seen.clear()
        with pytest.raises(TitoError):
            c.update_weights("/w")
        assert seen == ["/update_weights"]  # never repeated: an NCCL update must not run twice
        seen.clear()
        with pytest.raises(TitoError):
            c.generate([1, 2])
        assert seen == ["/inference/v1/generate"]


def test_connection_refused_is_retried_then_raised_with_status_zero() -> None:
    with TitoClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff=0.001) as c:
        with pytest.raises(TitoError) as e:
            c.generate([1, 2, 3], max_tokens=1)
    assert e.value.status == 0 and "ConnectError" in e.value.message


async def test_async_client_sends_bearer_keys_by_plane() -> None:
    seen: dict[str, str | None] = {}

    def handler(req: httpx.Request) -> httpx.Response:
        seen[req.url.path] = req.headers.get("authorization")
        return httpx.Response(200, json={"status": "ok", "is_paused": False, "object": "list", "data": []})

    async with AsyncTitoClient("http://x/v1", api_key="d", admin_api_key="a",
                               transport=httpx.MockTransport(handler)) as c:
        await c.models()
        await c.pause()
        await c.is_paused()
        await c.load_lora("n", "/p", v1=True)
        await c.health()
    assert seen == {"/v1/models": "Bearer d", "/pause": "Bearer a", "/is_paused": "Bearer a",
                    "/v1/load_lora_adapter": "Bearer a", "/health": None}


# ------------------------------------------------------------------------------------------------ shared server


@pytest.mark.engine
def test_generate_returns_typed_result_equal_to_raw_http(tc: TitoClient, client: httpx.Client) -> None:
    out = tc.generate(PROMPT, max_tokens=6, temperature=0, logprobs=2, prompt_logprobs=1, request_id="c-typed")
    raw = client.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 6, "temperature": 0, "logprobs": 2, "prompt_logprobs": 1}}).json()
    assert isinstance(out, GenerateResult)
    assert out.request_id == "generate-tokens-c-typed"
    assert out.token_ids == raw["choices"][0]["token_ids"] and len(out.token_ids) == 6
    assert out.logprobs == pytest.approx([e["logprob"] for e in raw["choices"][0]["logprobs"]["content"]])
    assert out.choices[0].top_logprobs is not None and all(len(t) == 2 for t in out.choices[0].top_logprobs)
    assert out.finish_reason == "length"
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 6)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 5


@pytest.mark.engine
def test_sampling_params_dict_and_keywords_merge(tc: TitoClient) -> None:
    out = tc.generate(PROMPT, {"max_tokens": 2, "temperature": 0, "n": 1}, max_tokens=3, return_token_ids=True)
    assert len(out.token_ids) == 3  # the keyword wins
    assert out.prompt_token_ids == PROMPT


@pytest.mark.engine
def test_sync_stream_yields_deltas_that_add_up(tc: TitoClient) -> None:
    full = tc.generate(PROMPT, max_tokens=8, temperature=0, logprobs=1)
    deltas = list(tc.generate_stream(PROMPT, max_tokens=8, temperature=0, logprobs=1, include_usage=True))
    assert all(isinstance(d, StreamDelta) for d in deltas)
    toks = [t for d in deltas if d.index == 0 for t in d.token_ids]
    lps = [x for d in deltas if d.index == 0 for x in (d.logprobs or [])]
    assert toks == full.token_ids
    assert lps == pytest.approx(full.logprobs or [], abs=1e-4)
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
    assert deltas[-1].index == -1 and deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == 8


@pytest.mark.engine
async def test_async_generate_stream_and_probes(tito_url: str) -> None:
    async with AsyncTitoClient(tito_url, timeout=120) as c:
        out, streamed = await asyncio.gather(
            c.generate(PROMPT, max_tokens=5, temperature=0),
            _collect(c.generate_stream(PROMPT, max_tokens=5, temperature=0)))
        assert streamed == out.token_ids and len(out.token_ids) == 5
        health, live, ready, version, models, info = await asyncio.gather(
            c.health(), c.liveness(), c.ready(), c.version(), c.models(), c.server_info())
        metrics = await c.metrics()
        assert await c.is_paused() is False
    assert health["status"] == "ok" and live["status"] == "ok"
    assert ready["status"] in ("ready", "ok")
    assert version["vllm_version"] == "0.32.0"
    assert models["data"][0]["max_model_len"] == 512 or models["data"][0]["max_model_len"] > 0
    assert info["model"]["served_model_name"] == models["data"][0]["id"]
    assert "vllm:num_requests_running" in metrics and "tito_requests_total" in metrics


async def _collect(stream) -> list[int]:  # noqa: ANN001 - an async iterator of StreamDelta
    return [t async for d in stream for t in d.token_ids]


@pytest.mark.engine
def test_sync_probes(tc: TitoClient) -> None:
    assert tc.health()["status"] == "ok"
    assert tc.liveness()["status"] == "ok"
    assert tc.ready()
    assert tc.version()["version"]
    assert tc.models()["object"] == "list"
    assert tc.server_info()["state"]["engine"] == "alive"
    assert "vllm:kv_cache_usage_perc" in tc.metrics()
    assert tc.is_paused() is False
    assert tc.drain_status()["draining"] is False
    assert tc.wait_healthy(timeout=5)["status"] == "ok"


@pytest.mark.engine
def test_errors_carry_the_server_envelope(tc: TitoClient) -> None:
    with pytest.raises(TitoError) as e:
        tc.generate([100000], max_tokens=1)
    assert e.value.status == 400 and e.value.error["code"] == 400 and e.value.param
    assert "100000" in e.value.message or "vocab" in e.value.message
    with pytest.raises(TitoError) as e:
        tc.generate(PROMPT, max_tokens=1, model="no-such-model")
    assert e.value.status == 404 and e.value.type == "NotFoundError" and e.value.param == "model"
    with pytest.raises(TitoError) as e:
        list(tc.generate_stream([100000], max_tokens=1))
    assert e.value.status == 400


# ------------------------------------------------------------------------------------------------ own server


@pytest.mark.engine
def test_keys_are_required_and_sent(admin_server: ServerProcess, admin: TitoClient) -> None:
    with TitoClient(admin_server.url) as anon, pytest.raises(TitoError) as e:
        anon.generate(PROMPT, max_tokens=1)
    assert e.value.status == 401
    with TitoClient(admin_server.url, api_key=DATA_KEY) as data_only:
        assert len(data_only.generate(PROMPT, max_tokens=1).token_ids) == 1
        with pytest.raises(TitoError) as e:
            data_only.pause()
        assert e.value.status == 401 and "admin" in e.value.message
        assert data_only.health()["status"] == "ok"  # probes are open
    assert admin.is_paused() is False


@pytest.mark.engine
async def test_abort_ends_a_running_stream_with_finish_reason_abort(admin_server: ServerProcess) -> None:
    # The engine is frozen (pause mode=keep) before the request arrives, so it is certainly still running when aborted
    # however slow or fast the machine: the tiny model can finish all its tokens before a client reads its first event.
    max_tokens = KEYED_MAX_MODEL_LEN - len(PROMPT)  # the whole context the keyed server allows
    rid = f"abort-{uuid.uuid4().hex[:8]}"
    async with AsyncTitoClient(admin_server.url, api_key=DATA_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
        got: list[int] = []
        reasons: list[str] = []

        async def consume() -> None:
            async for d in c.generate_stream(PROMPT, max_tokens=max_tokens, ignore_eos=True, request_id=rid):
                got.extend(d.token_ids)
                if d.finish_reason:
                    reasons.append(d.finish_reason)

        try:
            await c.pause(mode="keep")
            reader = asyncio.ensure_future(consume())
            deadline = asyncio.get_running_loop().time() + 60
            while (await c.drain_status())["inflight"] < 1:
                assert asyncio.get_running_loop().time() < deadline and not reader.done(), "request never admitted"
                await asyncio.sleep(0.02)
            aborted = await c.abort([rid])
        finally:
            await c.resume()
        await asyncio.wait_for(reader, 60)
        assert aborted == {"status": "aborted", "aborted": 1}
        assert await c.abort(["no-such-request"]) == {"status": "aborted", "aborted": 0}
    assert reasons == ["abort"] and len(got) < max_tokens


@pytest.mark.engine
def test_pause_resume(admin: TitoClient) -> None:
    try:
        assert admin.pause(mode="keep", clear_cache=False)["status"] == "paused"
        assert admin.is_paused() is True
        assert admin.pause(mode="keep")["status"] == "paused"  # idempotent
    finally:
        assert admin.resume()["status"] == "resumed"
    assert admin.is_paused() is False
    assert len(admin.generate(PROMPT, max_tokens=2).token_ids) == 2


@pytest.mark.engine
def test_paused_block_resumes_also_when_it_raises(admin: TitoClient, tiny_model: Path) -> None:
    """README's snippet as a newcomer first runs it: an update refused (403, a path outside the allowed roots) inside
    ``with c.paused()`` leaves the server generating, not paused for ever; then the async flavour's happy path."""
    with pytest.raises(TitoError) as e, admin.paused():
        assert admin.is_paused() is True
        admin.update_weights("/ckpt/step_7", weight_version="step_7")
    assert e.value.status == 403 and e.value.param == "weight_dir"
    assert admin.is_paused() is False
    assert len(admin.generate(PROMPT, max_tokens=2).token_ids) == 2

    async def update() -> tuple[bool, str]:
        async with AsyncTitoClient(admin.base_url, api_key=DATA_KEY, admin_api_key=ADMIN_KEY, timeout=120) as ac:
            async with ac.paused(mode="abort"):
                paused = await ac.is_paused()
                await ac.update_weights(str(tiny_model), weight_version="ctx-v1")
            return paused, (await ac.server_info())["state"]["weight_version"]

    try:
        assert asyncio.run(update()) == (True, "ctx-v1")
        assert admin.is_paused() is False
    finally:
        restore_server(admin.base_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})


@pytest.mark.engine
def test_a_pause_lease_ends_the_pause_nobody_ends(admin_server: ServerProcess, admin: TitoClient) -> None:
    """A pause with a lease and no control call after it: tito resumes by itself, in the control queue, logs it and
    counts it. A resume before the lease runs out ends the lease (nothing fires later)."""
    def expired() -> float:
        return metric_value(admin.metrics(), "tito_pause_lease_expired_total", {"outcome": "resumed"}) or 0.0

    def control() -> dict[str, object]:
        return dict(admin.server_info()["state"]["control"])

    before = expired()
    try:
        admin.pause(mode="keep", lease=600)
        assert control()["pause_lease_s"] == 600 and 0 < float(control()["pause_lease_left_s"]) <= 600  # type: ignore[arg-type]
        admin.resume()
        assert control()["pause_lease_s"] is None  # resumed: no lease left to fire
        admin.pause(mode="keep", lease=1.0)
        assert admin.is_paused() is True
        deadline = time.monotonic() + 60
        while admin.is_paused():
            assert time.monotonic() < deadline, "the lease never resumed the server"
            time.sleep(0.1)
        assert expired() == before + 1
        recent = [c["call"] for c in control()["recent"]]  # type: ignore[union-attr]
        assert recent[-1] == "resume (pause lease expired)"
        assert "pause lease of 1s expired with no control call since" in admin_server.log_path.read_text()
        assert len(admin.generate(PROMPT, max_tokens=2).token_ids) == 2
    finally:
        admin.resume()


@pytest.mark.engine
def test_drain_refuses_new_work_until_undrain(admin: TitoClient) -> None:
    try:
        out = admin.drain(timeout=10)
        assert out["status"] == "drained" and out["still_running"] == 0
        assert admin.drain_status()["draining"] is True
        with pytest.raises(TitoError) as e:
            admin.generate(PROMPT, max_tokens=1)
        assert e.value.status == 503 and "draining" in e.value.message
    finally:
        assert admin.undrain()["draining"] is False
    assert len(admin.generate(PROMPT, max_tokens=1).token_ids) == 1


@pytest.mark.engine
def test_update_weights_from_disk_sets_the_version(admin: TitoClient, tiny_model: Path) -> None:
    before = admin.generate(PROMPT, max_tokens=4, temperature=0)
    out = admin.update_weights(str(tiny_model), weight_version="client-v1")
    assert out["status"] == "ok" and out["weight_version"] == "client-v1"
    assert admin.server_info()["state"]["weight_version"] == "client-v1"
    after = admin.generate(PROMPT, max_tokens=4, temperature=0)
    assert after.token_ids == before.token_ids  # same weights reloaded
    assert after.choices[0].weight_versions == [{"version": "client-v1", "start": 0, "end": 4}]
    with pytest.raises(TitoError) as e:
        admin.update_weights("/etc")
    assert e.value.status == 403 and e.value.param == "weight_dir"


def _write_adapter(path: Path, seed: int) -> Path:
    import torch
    from safetensors.torch import save_file

    from app.tiny.model import TINY_CONFIG as C

    gen = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    outs = {"q_proj": C["num_attention_heads"] * C["head_dim"], "v_proj": C["num_key_value_heads"] * C["head_dim"]}
    tensors = {}
    for i in range(C["num_hidden_layers"]):
        for mod, out_dim in outs.items():
            p = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            tensors[p + ".lora_A.weight"] = torch.randn(8, C["hidden_size"], generator=gen) * 0.2
            tensors[p + ".lora_B.weight"] = torch.randn(out_dim, 8, generator=gen) * 0.2
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none",
        "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": "tiny-qwen3"}))
    return path


@pytest.mark.engine
def test_lora_load_reload_and_unload(admin: TitoClient, tmp_path: Path) -> None:
    a1, a2 = _write_adapter(tmp_path / "a1", 1), _write_adapter(tmp_path / "a2", 2)
    try:
        assert admin.load_lora("client-lora", str(a1))["status"] == "ok"
        assert admin.load_lora("client-lora", str(a2))["status"] == "ok"  # same name: reloaded in place
        assert "added successfully" in admin.load_lora("client-lora-v1", str(a1), v1=True)
        ids = {m["id"] for m in admin.models()["data"]}
        assert {"client-lora", "client-lora-v1"} <= ids
        out = admin.generate(PROMPT, max_tokens=3, temperature=0, model="client-lora")
        assert out.model == "client-lora" and len(out.token_ids) == 3
        names = [a.get("lora_name") or a.get("name") for a in admin.server_info()["state"]["loaded_adapters"]]
        assert "client-lora" in names
    finally:
        for name in ("client-lora", "client-lora-v1"):
            try:
                admin.unload_lora(name)
            except TitoError:
                pass
    assert not {"client-lora", "client-lora-v1"} & {m["id"] for m in admin.models()["data"]}
    with pytest.raises(TitoError) as e:
        admin.unload_lora("client-lora")
    assert e.value.status == 404


@pytest.mark.engine
def test_init_broadcaster_joins_a_trainer_group(admin: TitoClient) -> None:
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    port = free_port()
    trainer: dict[str, object] = {}

    def rank0() -> None:
        try:
            trainer["pg"] = stateless_init_torch_distributed_process_group("127.0.0.1", port, 0, 2, "gloo",
                                                                           timeout=timedelta(seconds=90))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            trainer["error"] = e

    th = threading.Thread(target=rank0, daemon=True)
    th.start()
    out = admin.init_broadcaster("127.0.0.1", port, rank_offset=0, inference_world_size=1, timeout=90)
    th.join(60)
    assert "error" not in trainer and "pg" in trainer
    assert out["status"] == "ok" and out["ranks"] == [1] and out["world_size"] == 2


@pytest.mark.engine
def test_request_log_lines_are_json_with_the_request_id(admin_server: ServerProcess, admin: TitoClient) -> None:
    rid = f"log-{uuid.uuid4().hex[:8]}"
    admin.generate(PROMPT, max_tokens=1, request_id=rid)
    admin.health()

    def access_lines() -> tuple[list[dict], list[dict]]:
        lines = [ln for ln in admin_server.log_text().splitlines() if ln.startswith("{")]
        records = [json.loads(ln) for ln in lines if ln.endswith("}")]  # not a line still being written
        access = [r for r in records if r.get("logger") == "tito.request"]
        return access, [r for r in access if r.get("request_id") == f"generate-tokens-{rid}"]

    # The access line is written after the answer has been sent, so the client can read the log before it is there.
    deadline = time.monotonic() + 30
    access, gen = access_lines()
    while not gen:
        assert time.monotonic() < deadline, admin_server.log_tail()
        time.sleep(0.05)
        access, gen = access_lines()
    assert len(gen) == 1 and gen[0]["msg"].startswith("POST /inference/v1/generate 200 ")
    assert any(r["msg"].startswith("GET /health 200 ") and r.get("request_id") for r in access)
    # One access line per request, each with an id.
    assert all(r.get("request_id") for r in access)


@pytest.mark.engine
async def test_async_client_admin_methods(admin_server: ServerProcess, tiny_model: Path, tmp_path: Path) -> None:
    adapter = _write_adapter(tmp_path / "async-a", 5)
    async with AsyncTitoClient(admin_server.url, api_key=DATA_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
        try:
            assert (await c.pause(mode="wait"))["status"] == "paused"
            assert await c.is_paused() is True
        finally:
            assert (await c.resume())["status"] == "resumed"
        assert await c.is_paused() is False
        try:
            assert (await c.drain(timeout=5))["status"] == "drained"
            assert (await c.drain_status())["draining"] is True
        finally:
            assert (await c.undrain())["draining"] is False
        out = await c.update_weights(str(tiny_model), weight_version="async-v1")
        assert out["weight_version"] == "async-v1"
        try:
            assert (await c.load_lora("async-lora", str(adapter)))["status"] == "ok"
            assert "async-lora" in {m["id"] for m in (await c.models())["data"]}
        finally:
            assert "removed successfully" in await c.unload_lora("async-lora")
        assert (await c.server_info())["state"]["weight_version"] == "async-v1"
        assert (await c.wait_healthy(timeout=5))["status"] == "ok"
        with pytest.raises(TitoError) as e:
            await c.init_broadcaster("127.0.0.1", free_port(), 0, 1, timeout=1, extra={"backend": "mpi"})
        assert e.value.status == 400 and e.value.param == "backend"
