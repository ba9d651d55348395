"""GET /metrics: the engine's vllm:* families Prime-RL's concurrency controller reads (present, and moving under
load), and tito's own families (requests by route/status, rejections, in-flight, drain, pause, weight version)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import SharedServers, module_server, start_tito
from tests.helpers import (
    TIMING,
    ServerProcess,
    metric_value,
)
from tests.logprob_modes import check_logprobs_mode
from tests.streaming import long_context_model

pytestmark = pytest.mark.engine

GEN = "/inference/v1/generate"
# What orchestrator/concurrency.py needs (prime-rl-contract.md §4).
ENGINE_FAMILIES = ["vllm:cache_config_info", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                   "vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason", "vllm:num_preemptions_total"]


# Tokens per request under load. Long on purpose: the tiny model decodes thousands of steps per second, so 300-token
# requests were all done before a scrape answered and the samples saw nothing. With these, each pair of requests runs
# for thousands of steps while the others wait, even if this process is descheduled for a while.
PROMPT_LEN, MAX_TOKENS = 100, 1900
CONTEXT = PROMPT_LEN + MAX_TOKENS + 96


@module_server("tito-metrics")
def start_small(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> ServerProcess:
    """Two sequences at a time, so a handful of requests keeps some waiting for capacity; and a KV cache of 20 blocks
    of 128 tokens, room for one 2000-token request but not two, so the scheduler preempts under that load.

    Its tokenizer also declares an eos that is not among the model's ids (``eos_outside_vocabulary``): this server is
    the one engine of the suite that model directory costs nothing extra on; the metrics tests never use the eos."""
    model = eos_outside_vocabulary(long_context_model(tmp_path_factory.mktemp("metrics-model") / "tiny-long",
                                                      CONTEXT))
    # vLLM's --logprobs-mode processed_logits as well: no test of this module reads a logprob, so the mode's own
    # test (below) costs no engine start of its own.
    return start_tito(tmp_path_factory, model, "--max-model-len", str(CONTEXT), "--max-num-seqs", "2",
                      "--num-kv-blocks", "20", "--logprobs-mode", "processed_logits", name="tito-metrics")


@pytest.fixture(scope="module")
def small(shared_servers: SharedServers) -> ServerProcess:
    return shared_servers.get("tito-metrics")


@pytest.fixture
def c(small) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=small.url, timeout=120.0) as cl:
        yield cl


def test_logprobs_mode_processed_logits(c: httpx.Client, small: ServerProcess) -> None:
    """`logprobs` hold the logits after temperature and top-k (not log-softmaxed); prompt rows the raw logits."""
    check_logprobs_mode(c, small.cmd[small.cmd.index("--model") + 1], "processed_logits")


def eos_outside_vocabulary(model: Path) -> Path:
    """What a fine-tune leaves when it adds a special token as eos without resizing the embeddings: the tokenizer's eos
    gets id 512 of a 512-id model (the CI run where a test fixture did this by accident lost its engine)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = json.loads((model / name).read_text())
        (model / name).write_text(json.dumps({**cfg, "eos_token": "<|endoftext|>"}))
    return model


def scrape(c: httpx.Client) -> str:
    r = c.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return r.text


def val(text: str, name: str, **labels: str) -> float:
    v = metric_value(text, name, labels or None)
    assert v is not None, f"{name}{labels} missing"
    return v


def test_engine_families_present(c):
    text = scrape(c)
    for fam in ENGINE_FAMILIES:
        assert metric_value(text, fam) is not None, fam
    assert metric_value(text, "vllm:num_requests_waiting_by_reason", {"reason": "capacity"}) is not None
    # cache_config_info carries the KV capacity as labels (kv_cache_size_tokens, or num_gpu_blocks x block_size).
    line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert int(labels["kv_cache_size_tokens"]) > 0 or int(labels["num_gpu_blocks"]) * int(labels["block_size"]) > 0
    assert "tito_inflight_requests" in text and "tito_requests_total" in text


@TIMING
def test_engine_and_inflight_gauges_move_under_load(c, small):
    before = scrape(c)
    assert val(before, "vllm:num_requests_running") == 0
    assert val(before, "tito_inflight_requests") == 0
    n = 3  # two run (max_num_seqs), the third waits for a slot: each gauge below moves; more only add decoding time
    body = {"token_ids": list(range(1, PROMPT_LEN + 1)), "sampling_params": {"max_tokens": MAX_TOKENS,
                                                                             "temperature": 0, "ignore_eos": True}}

    def one(_: int) -> int:
        with httpx.Client(base_url=small.url, timeout=300.0) as cl:
            return cl.post(GEN, json=body).status_code

    def sample(seen: dict[str, float]) -> None:
        text = scrape(c)
        for key, name, labels in (("running", "vllm:num_requests_running", {}),
                                  ("waiting", "vllm:num_requests_waiting", {}),
                                  ("capacity", "vllm:num_requests_waiting_by_reason", {"reason": "capacity"}),
                                  ("kv", "vllm:kv_cache_usage_perc", {}),
                                  ("inflight", "tito_inflight_requests", {})):
            seen[key] = max(seen.get(key, 0.0), val(text, name, **labels))

    seen: dict[str, float] = {}
    pool = ThreadPoolExecutor(n)
    try:
        # Frozen until every request is admitted: all n are surely in flight at once, however fast the machine.
        assert c.post("/pause", params={"mode": "keep"}).status_code == 200
        futures = [pool.submit(one, i) for i in range(n)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and val(scrape(c), "tito_inflight_requests") < n:
            time.sleep(0.02)
        sample(seen)
        assert seen["inflight"] == n, seen
        # Then generation runs two at a time: the first pair runs together for some 1,200 decoding steps (until the
        # KV cache is full) while the others wait for a slot. Sample often until that has been seen.
        assert c.post("/resume").status_code == 200
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not all(f.done() for f in futures):
            sample(seen)
            if seen.get("running", 0) == 2 and seen.get("capacity", 0) >= 1 and seen.get("waiting", 0) >= 1 \
                    and seen.get("kv", 0) > 0:
                break
            time.sleep(0.01)
        assert [f.result(timeout=300) for f in futures] == [200] * n
    finally:
        c.post("/resume")
        pool.shutdown(wait=True)
    assert seen["running"] == 2, seen  # max_num_seqs
    assert seen["waiting"] >= 1 and seen["capacity"] >= 1, seen  # the rest wait for a slot
    assert seen["kv"] > 0, seen
    assert seen["inflight"] == n, seen
    # The engine publishes its gauges with its next scheduler stats: wait for them to come back to 0.
    deadline = time.monotonic() + 30
    after = scrape(c)
    busy = ("vllm:num_requests_running", "vllm:num_requests_waiting", "tito_inflight_requests")
    while time.monotonic() < deadline and any(val(after, name) for name in busy):
        time.sleep(0.05)
        after = scrape(c)
    assert val(after, "vllm:num_requests_running") == 0
    assert val(after, "vllm:num_requests_waiting") == 0
    assert val(after, "tito_inflight_requests") == 0
    assert val(after, "vllm:request_success_total") >= val(before, "vllm:request_success_total") + n
    # Two running requests outgrow the 20-block KV cache: the scheduler preempts one.
    assert val(after, "vllm:num_preemptions_total") > val(before, "vllm:num_preemptions_total")


def test_requests_counted_by_route_and_status_and_rejections_by_reason(c):
    before = scrape(c)
    assert c.get("/v1/models").status_code == 200
    assert c.post(GEN, json={"token_ids": [100000]}).status_code == 400  # out of vocabulary
    assert c.post(GEN, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    assert c.get("/no/such/route").status_code == 404
    assert c.post(GEN, content=b"x" * 9_000_000, headers={"content-type": "application/json"}).status_code == 413
    ok = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}}
    assert c.post(GEN, json=ok).status_code == 200
    with c.stream("POST", GEN, json={**ok, "stream": True}) as r:
        assert r.status_code == 200 and r.read().rstrip().endswith(b"data: [DONE]")

    def delta(name: str, **labels: str) -> float:
        return (metric_value(after, name, labels) or 0.0) - (metric_value(before, name, labels) or 0.0)

    # Counted before the last chunk of each answer left the server: one scrape, right away, sees every request.
    after = scrape(c)
    assert delta("tito_requests_total", route="/v1/models", status="200") == 1
    assert delta("tito_requests_total", route=GEN, status="400") == 2
    assert delta("tito_requests_total", route=GEN, status="200") == 2  # the JSON answer and the stream
    assert delta("tito_requests_total", route="unmatched", status="404") == 1
    assert delta("tito_rejected_requests_total", reason="bad_request") == 2
    assert delta("tito_rejected_requests_total", reason="not_found") == 1
    assert delta("tito_rejected_requests_total", reason="body_too_large") == 1
    # Labels are route templates, never raw paths: no label for the unknown path itself.
    assert "/no/such/route" not in after


def test_state_gauges_follow_pause_drain_and_weight_version(c):
    try:
        assert c.post("/pause", params={"mode": "keep"}).status_code == 200
        assert val(scrape(c), "tito_paused") == 1
        assert c.post("/resume").status_code == 200
        assert val(scrape(c), "tito_paused") == 0

        assert c.post("/drain", json={"timeout": 1}).status_code == 200
        assert val(scrape(c), "tito_draining") == 1
        assert c.delete("/drain").status_code == 200
        assert val(scrape(c), "tito_draining") == 0

        r = c.post("/update_weight_version", json={"new_version": "step-7"})
        assert r.status_code == 200, r.text
        text = scrape(c)
        assert val(text, "tito_weight_version_info", version="step-7") == 1
        assert metric_value(text, "tito_weight_version_info", {"version": "default"}) is None
    finally:
        c.post("/resume")
        c.delete("/drain")


def test_an_eos_outside_the_vocabulary_refuses_min_tokens_and_the_engine_serves(c: httpx.Client) -> None:
    """vLLM masks the tokenizer's eos while min_tokens is unmet by indexing the logits with it; id 512 of 512 logits
    killed the EngineCore. tito refuses min_tokens on such a server (every route), serves everything else."""
    body = {"token_ids": [3, 1, 4, 1, 5], "sampling_params": {"max_tokens": 4, "min_tokens": 2, "temperature": 0}}
    r = c.post(GEN, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "sampling_params.min_tokens" and "[512]" in err["message"], err
    r = c.post("/v1/completions", json={"model": c.get("/v1/models").json()["data"][0]["id"], "prompt": [3, 1, 4],
                                        "max_tokens": 4, "min_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    # min_tokens 0 (the default) and the rest of the request shapes are served; the engine is alive afterwards.
    body["sampling_params"]["min_tokens"] = 0
    r = c.post(GEN, json=body)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4, r.text
    assert c.get("/health").status_code == 200
    assert c.get("/server_info").json()["features"]["min_tokens"] is False
