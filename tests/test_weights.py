"""RL weight lifecycle on the real engine: pause/resume modes, updates from disk (valid and invalid checkpoints),
idempotency, serialization, cancellation, version spans, and an update storm under 64 concurrent streams."""

from __future__ import annotations

import asyncio
import json
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from app.tiny.model import TINY_CONFIG, tiny_state_dict
from tests.conftest import FRESH_BODIES
from tests.helpers import (
    TIMING,
    ServerProcess,
    metric_value,
    restore_server,
)

GEN = "/inference/v1/generate"
PROMPTS = [[1, 2, 3, 4, 5], [17, 300, 42, 9]]
# max_tokens of a request that must still be running when an admin call lands. No length is long enough on a busy
# 2-core machine, where the test process can be descheduled for seconds while the engine generates, so such a request
# is endless: it cannot finish within a test on any machine (~1500 tokens/s at most here) and the test ends it itself
# with /abort_requests or /pause?mode=abort, never by waiting for it. The shared long-context server's context fits
# it (a prompt of a few tokens + ENDLESS); its KV cache (~1 KiB per token for the tiny model, 1 GiB) holds it ~17 times.
ENDLESS = 60000
pytestmark = pytest.mark.engine


# ------------------------------------------------------------------------------------------ helpers


def write_step(directory: Path, sd: dict[str, torch.Tensor], *, config: bool = False, shards: int = 1) -> Path:
    """Write ``sd`` as a trainer does: model.safetensors, or shards + index; no config.json unless asked."""
    directory.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        save_file(sd, str(directory / "model.safetensors"))
    else:
        names = sorted(sd)
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: sd[k] for k in names[i::shards]}
            save_file(part, str(directory / fname))
            weight_map.update({k: fname for k in part})
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
             "weight_map": weight_map}))
    if config:
        (directory / "config.json").write_text(json.dumps(TINY_CONFIG))
    return directory


def reference_greedy(sd: dict[str, torch.Tensor], directory: Path, prompts: list[list[int]], n: int) -> list:
    """transformers greedy on ``sd`` (fp32): the independent answer for "a fresh engine on these weights"."""
    from tests.reference import Reference

    write_step(directory, {k: v.float() for k, v in sd.items()}, config=True)
    ref = Reference(directory)
    return [ref.greedy(p, n)[0] for p in prompts]


def greedy(client: httpx.Client, prompts: list[list[int]] = PROMPTS, n: int = 8) -> list[list[int]]:
    out = []
    for p in prompts:
        r = client.post(GEN, json={"token_ids": p, "sampling_params": {"max_tokens": n, "temperature": 0}})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def update(client: httpx.Client, directory: Path | str | None, **kw: object) -> httpx.Response:
    return client.post("/update_weights", json={"weight_dir": None if directory is None else str(directory), **kw})


def rl_step(client: httpx.Client, directory: Path, mode: str = "keep", **kw: object) -> dict:
    """What Prime-RL's orchestrator does per step: pause, update, resume (in finally)."""
    assert client.post("/pause", params={"mode": mode, "clear_cache": "false"}).json() == {"status": "paused"}
    try:
        r = update(client, directory, **kw)
        assert r.status_code == 200, r.text
        return r.json()
    finally:
        assert client.post("/resume").json() == {"status": "resumed"}


class Background:
    """Run a blocking call in a thread; ``result()`` joins it."""

    def __init__(self, fn, *args, **kw) -> None:  # noqa: ANN001
        self.value: object = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn(*args, **kw)
            except BaseException as e:  # noqa: BLE001
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return not self.thread.is_alive()

    def result(self, timeout: float = 120.0) -> object:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "background call did not finish"
        if self.error:
            raise self.error
        return self.value


def long_request(url: str, max_tokens: int, prompt: list[int] | None = None, stream: bool = False,
                 tokens: list[int] | None = None, request_id: str | None = None) -> dict:
    """A greedy request, plain JSON or streamed; a stream appends its tokens to ``tokens`` as they arrive."""
    body: dict = {"token_ids": prompt or [5, 6, 7], "sampling_params": {"max_tokens": max_tokens, "temperature": 0,
                                                                         "ignore_eos": True}}
    if request_id is not None:
        body["request_id"] = request_id
    with httpx.Client(base_url=url, timeout=300) as c:
        if not stream:
            r = c.post(GEN, json=body)
            assert r.status_code == 200, r.text
            return r.json()
        toks = tokens if tokens is not None else []
        spans = finish = None
        with c.stream("POST", GEN, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                for ch in ev["choices"]:
                    toks.extend(ch["token_ids"])
                    spans = ch["weight_versions"] or spans
                    finish = ch["finish_reason"] or finish
        return {"choices": [{"token_ids": list(toks), "weight_versions": spans, "finish_reason": finish}]}


class Endless(Background):
    """An endless greedy request (``ENDLESS`` tokens) in a thread; the test ends it with ``abort()`` (or a pause in
    abort mode), and ``result()`` is then its answer: partial tokens, ``finish_reason: "abort"``."""

    def __init__(self, url: str, request_id: str, prompt: list[int] | None = None, stream: bool = True) -> None:
        self.url = url
        self.request_id = request_id
        self.tokens: list[int] = []  # a stream's tokens so far, appended by the request thread
        super().__init__(long_request, url, ENDLESS, prompt, stream, self.tokens, request_id)

    def abort(self, client: httpx.Client) -> None:
        r = client.post("/abort_requests", json={"request_ids": [self.request_id]})
        assert r.json() == {"status": "aborted", "aborted": 1}, r.text

    def wait_tokens(self, n: int, timeout: float = 120.0) -> None:
        """Wait until the stream's client has received more than ``n`` tokens."""
        deadline = time.monotonic() + timeout
        while len(self.tokens) <= n:
            assert time.monotonic() < deadline, f"the stream has {len(self.tokens)} tokens, not more than {n}"
            assert not self.done(), f"the endless request ended: {self.error!r} {self.value!r}"[:600]
            time.sleep(0.01)


def start_endless(client: httpx.Client, url: str, request_id: str, prompt: list[int] | None = None,
                  stream: bool = True) -> Endless:
    """Start an endless request and return once it has generated tokens, so it surely is in the engine: a stream's
    client has received some, or (plain JSON) the server's count of generated tokens went up. The latter assumes
    nothing else generates on this module's server meanwhile."""
    before = _generated(client)
    bg = Endless(url, request_id, prompt, stream)
    if stream:
        bg.wait_tokens(0)
        return bg
    deadline = time.monotonic() + 120
    while _generated(client) <= before:
        assert time.monotonic() < deadline, "the endless request never generated"
        assert not bg.done(), f"the endless request ended: {bg.error!r} {bg.value!r}"[:600]
        time.sleep(0.05)
    return bg


def _generated(client: httpx.Client) -> float:
    """Tokens the engine has generated so far (all requests), as the server counts them."""
    return metric_value(client.get("/metrics").text, "vllm:generation_tokens_total") or 0.0


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def server(long_tito: ServerProcess) -> Iterator[ServerProcess]:
    """The shared long-context server (the tiny model's weights, a context for the endless requests). Nothing else
    runs on it during this module; put back at the end (base weights, resumed, no broadcast group)."""
    yield long_tito
    restore_server(long_tito.url, drop_broadcaster=True)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120.0) as c:
        yield c


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


# ------------------------------------------------------------------------------------------ pause modes


def test_abort_mode_returns_partial_tokens(client, server):
    plain = start_endless(client, server.url, "abort-mode-plain", prompt=[9, 9, 9], stream=False)
    streamed = start_endless(client, server.url, "abort-mode-stream")
    try:
        # Endless: only the pause's abort can end them.
        assert client.post("/pause", params={"mode": "abort"}).json() == {"status": "paused"}
        for bg in (plain, streamed):
            choice = bg.result()["choices"][0]  # type: ignore[index]
            assert choice["finish_reason"] == "abort"
            assert 0 < len(choice["token_ids"]) < ENDLESS
    finally:
        client.post("/resume")
        client.post("/abort_requests", json={"request_ids": ["abort-mode-plain", "abort-mode-stream"]})


@TIMING
def test_new_requests_wait_during_a_pause(client, server):
    assert client.post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}
    assert client.get("/is_paused").json() == {"is_paused": True}
    try:
        bg = Background(long_request, server.url, 4)
        # Admitted (tito counts it in flight) and then given time it would need many times over to finish.
        deadline = time.monotonic() + 60
        while client.get("/health").json()["inflight"] < 1:
            assert time.monotonic() < deadline and not bg.done(), f"not admitted: {bg.error!r} {bg.value!r}"[:600]
            time.sleep(0.02)
        time.sleep(1.0)
        assert not bg.done(), "a request ran while generation was paused"
    finally:
        assert client.post("/resume").json() == {"status": "resumed"}
    data = bg.result()
    assert len(data["choices"][0]["token_ids"]) == 4
    assert client.get("/is_paused").json() == {"is_paused": False}


def test_keep_mode_request_straddles_an_update(client, server, root):
    d = write_step(root / "run" / "step_5", tiny_state_dict(55))
    generated0 = _generated(client)  # nothing else runs on this module's server meanwhile
    bg = start_endless(client, server.url, "straddle")  # tokens from the old weights have reached the client
    try:
        assert client.post("/pause", params={"mode": "keep", "clear_cache": "false"}).json() == {"status": "paused"}
        try:
            old = client.get("/weight_info").json()["weight_version"]
            r = update(client, d)
            assert r.status_code == 200, r.text
            # Frozen: the server's count of this request's tokens (all from the old weights) no longer grows once the
            # last outputs from before the pause are processed.
            before_update = _stable(lambda: _generated(client) - generated0)
        finally:
            client.post("/resume")
        # The client has tokens generated after the update (a margin for any output from before the pause still
        # unprocessed when counted; 64 tokens take a fraction of a second).
        bg.wait_tokens(int(before_update) + 64)
    finally:
        bg.abort(client)
    choice = bg.result()["choices"][0]  # type: ignore[index]
    n = len(choice["token_ids"])
    assert choice["finish_reason"] == "abort" and before_update + 64 < n < ENDLESS
    spans = choice["weight_versions"]
    assert [s["version"] for s in spans] == [old, "step_5"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == n
    assert 0 < spans[0]["end"] < n


def _stable(read, settle: float = 0.2, timeout: float = 30.0) -> float:  # noqa: ANN001
    """``read()`` once it gives the same value twice ``settle`` seconds apart."""
    deadline = time.monotonic() + timeout
    value = read()
    while True:
        time.sleep(settle)
        again = read()
        if again == value:
            return value
        assert time.monotonic() < deadline, "the value did not settle"
        value = again


def test_update_without_pause_waits_for_inflight_and_is_serialized_and_cancellation_safe(client, server, root):
    """Not paused: tito pauses with ``wait`` around the load. While it waits for an endless request: a different
    update is refused with 409; the first caller gives up (client timeout) yet the update goes on; once the request
    is aborted the load completes and the retry joins it."""
    d6 = write_step(root / "run" / "step_6", tiny_state_dict(66))
    d7 = write_step(root / "run" / "step_7", tiny_state_dict(77))
    bg = start_endless(client, server.url, "no-pause", stream=False)
    try:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/update_weights", json={"weight_dir": str(d6)}, timeout=0.5)
        r = update(client, d7)
        assert r.status_code == 409 and "another weight update" in r.json()["error"]["message"]
        retry = Background(update, client, d6)  # joins the running update, returns its outcome
    finally:
        bg.abort(client)  # the update's wait ends with the request
    retry_answer = retry.result()
    assert retry_answer.status_code == 200, retry_answer.text  # type: ignore[union-attr]
    assert retry_answer.json()["weight_version"] == "step_6"  # type: ignore[union-attr]
    choice = bg.result()["choices"][0]  # type: ignore[index]
    # wait mode: the in-flight request ran entirely on the old weights until it was aborted.
    n = len(choice["token_ids"])
    assert choice["finish_reason"] == "abort" and 0 < n < ENDLESS
    assert len(choice["weight_versions"]) == 1 and choice["weight_versions"][0] == {
        "version": choice["weight_versions"][0]["version"], "start": 0, "end": n}
    assert choice["weight_versions"][0]["version"] != "step_6"
    assert client.get("/weight_info").json() == {"weight_version": "step_6"}
    assert client.get("/is_paused").json() == {"is_paused": False}
    assert update(client, d6).json()["noop"] is True
    assert server.log_text().count("weights updated from disk: version=step_6") == 1


def test_resume_waits_for_a_running_update(client, server, root):
    d = write_step(root / "run" / "step_8", tiny_state_dict(88))
    old = client.get("/weight_info").json()["weight_version"]
    bg = start_endless(client, server.url, "resume-waits", stream=False)
    try:
        upd = Background(update, client, d)
        # The update pauses with `wait` and waits for the endless request; a resume must not cut in.
        deadline = time.monotonic() + 30
        while client.get("/is_paused").json() != {"is_paused": True}:
            assert time.monotonic() < deadline and not upd.done(), f"{upd.error!r} {upd.value!r}"[:600]
            time.sleep(0.02)
        res = Background(client.post, "/resume")
        # The update cannot end while the request runs, so neither may the resume. (A slow machine can only make this
        # check pass for a resume that does not wait, never fail for one that does.)
        time.sleep(1.0)
        assert not res.done(), "resume returned while the update was still waiting"
    finally:
        bg.abort(client)
    assert res.result().json() == {"status": "resumed"}  # type: ignore[union-attr]
    # The server's own state, not the update caller's thread (which may not have read its answer yet): when resume
    # answered, the update had finished.
    assert client.get("/weight_info").json() == {"weight_version": "step_8"}, \
        "resume returned while the update was still running"
    assert upd.result().status_code == 200  # type: ignore[union-attr]
    choice = bg.result()["choices"][0]  # type: ignore[index]
    # Aborted while the update still waited for it: all of it from the weights before.
    assert choice["finish_reason"] == "abort" and [s["version"] for s in choice["weight_versions"]] == [old]
    assert client.get("/weight_info").json() == {"weight_version": "step_8"}
    assert client.get("/is_paused").json() == {"is_paused": False}


# ------------------------------------------------------------------------------------------ under load


async def _stream(ac: httpx.AsyncClient, i: int, n: int, first: asyncio.Event | None = None) -> dict:
    body = {"token_ids": [1 + i % 50, 2, 3 + i % 7], "stream": True,
            "sampling_params": {"max_tokens": n, "temperature": 0, "ignore_eos": True}}
    toks: list[int] = []
    spans = None
    finish = None
    async with ac.stream("POST", GEN, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            for c in ev["choices"]:
                toks += c["token_ids"]
                spans = c["weight_versions"] or spans
                finish = c["finish_reason"] or finish
            if toks and first is not None:
                first.set()
    return {"tokens": toks, "spans": spans, "finish": finish}


async def _storm(url: str, dirs: list[Path], n: int) -> tuple[list, list]:
    """64 streams in waves, one wave in the engine whenever an update (keep, wait, keep, ...) starts."""
    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as ac:
        streams: list[asyncio.Future] = []
        answers = []
        waves = [13, 13, 13, 13, 12]
        for k, (d, size) in enumerate(zip(dirs, waves, strict=True)):
            base = len(streams)
            firsts = [asyncio.Event() for _ in range(size)]
            streams += [asyncio.ensure_future(_stream(ac, base + i, n, firsts[i])) for i in range(size)]
            # The wave is generating (each stream has a token) when the update starts: its first tokens come from
            # the version the previous update set, so every version but the last is surely seen.
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 120)
            mode = "keep" if k % 2 == 0 else "wait"
            if mode == "keep":
                assert (await ac.post("/pause", params={"mode": "keep"})).status_code == 200
            r = await ac.post("/update_weights", json={"weight_dir": str(d)})
            answers.append((r.status_code, r.json()))
            if mode == "keep":
                assert (await ac.post("/resume")).status_code == 200
        results = await asyncio.gather(*streams, return_exceptions=True)
    return list(results), answers


@TIMING
def test_64_streams_during_5_updates(client, server, root):
    dirs = [write_step(root / "storm" / f"step_{10 + k}", tiny_state_dict(100 + k)) for k in range(5)]
    results, answers = asyncio.run(_storm(server.url, dirs, 48))
    assert [a[0] for a in answers] == [200] * 5, answers
    assert [a[1]["weight_version"] for a in answers] == [f"step_{10 + k}" for k in range(5)]
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures[:3]
    seen: set[str] = set()
    for res in results:
        assert isinstance(res, dict)
        assert len(res["tokens"]) == 48 and res["finish"] == "length"
        spans = res["spans"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == 48
        assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:], strict=False))
        seen.update(s["version"] for s in spans)
    # Wave k >= 1 has its first tokens from step_{10+k-1}: at least step_10..step_13 are seen.
    assert {f"step_{10 + k}" for k in range(4)} <= seen, seen
    # Spans follow the update order (a stream that straddled an update names the older version first). That a
    # keep-mode pause freezes a stream across an update is asserted deterministically in the straddle test.
    order = {"default": -1, **{f"step_{10 + k}": k for k in range(5)}}
    for res in results:
        idx = [order.get(s["version"], -2) for s in res["spans"]]
        assert idx == sorted(idx), res["spans"]
    assert client.get("/is_paused").json() == {"is_paused": False}


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
