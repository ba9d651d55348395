"""Seeded sampling through weight updates and KV-cache pressure on CPU, on a tiny model whose rotary
settings differ from the defaults (rope_theta 1e6).

vLLM rewinds a seeded request's generator (``gen.set_offset``) whenever a step computes fewer tokens than the
request holds, which a CPU generator cannot do: the EngineCore died. Such steps are chunked prefills: a prompt
longer than the step's token budget (2,048 tokens, vLLM's CPU default, which tito keeps), or the recompute of a
preempted request (KV-cache pressure, or the preemption a weight update's
``reset_prefix_cache(reset_running_requests=True)`` does to requests frozen by ``pause?mode=keep``) shared with other
work. tito's fix (app/engine/vllm_patches.py, 7) restores such a generator's state instead; these tests fail without
it (``TITO_VLLM_PATCHES=0``: the engine dies)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.tiny.model import TINY_CONFIG, make_tiny_model, tiny_state_dict
from tests.conftest import SharedServers, module_server, start_tito
from tests.helpers import ServerProcess, greedy_answer, metric_value
from tests.logprob_modes import check_logprobs_mode
from tests.rl_steps import GEN, PROMPTS, greedy, write_step
from tests.streaming import read_stream

pytestmark = pytest.mark.engine
CONTEXT = 4096
ROPE = {**TINY_CONFIG, "max_position_embeddings": CONTEXT, "rope_theta": 1_000_000.0}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("seeded")


@module_server("seeded")
def start_server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> ServerProcess:
    """40 KV blocks of 128 tokens (5120 tokens): one full-context request fits, eight long ones do not."""
    base = make_tiny_model(tmp_path_factory.mktemp("seeded-model") / "rope-base")
    (base / "config.json").write_text(json.dumps(ROPE))
    # vLLM's --logprobs-mode raw_logits as well: this module compares logprobs only with its own earlier answers, so
    # the mode's own test (the module's first, on the base weights) costs no engine start of its own.
    return start_tito(tmp_path_factory, base, "--max-model-len", str(CONTEXT), "--num-kv-blocks", "40",
                      "--logprobs-mode", "raw_logits", name="seeded")


@pytest.fixture(scope="module")
def server(shared_servers: SharedServers) -> ServerProcess:
    return shared_servers.get("seeded")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=600.0) as c:
        yield c


@pytest.fixture(scope="module")
def fresh(client: httpx.Client) -> dict:
    return greedy_answer(client)


def test_logprobs_mode_raw_logits(client: httpx.Client, server: ServerProcess) -> None:
    """`logprobs` hold the model's logits before any processing; prompt rows too. First: the weights are the base."""
    check_logprobs_mode(client, server.cmd[server.cmd.index("--model") + 1], "raw_logits")


def seeded(i: int, prompt_len: int, n: int) -> dict:
    return {"token_ids": [(7 * i + k) % 500 + 1 for k in range(prompt_len)], "stream": True,
            "sampling_params": {"max_tokens": n, "temperature": 1.0, "seed": 1000 + i, "ignore_eos": True}}


async def _stream(ac: httpx.AsyncClient, body: dict, first: asyncio.Event) -> dict:
    out = await read_stream(ac, body, first)
    assert out["status"] == 200 and not out["errors"], out
    return out


def alive(client: httpx.Client) -> None:
    assert client.get("/health").json()["status"] == "ok"
    assert len(greedy(client)[0]) == 8


def test_seeded_prompt_longer_than_a_step_budget(client, fresh):
    """3000 prompt tokens > the 2048-token step budget: prefilled in two chunks, the first of which samples a token
    and throws it away. The same request again reads 2,944 of its tokens from the prefix cache and computes the rest
    in one step, with nothing thrown away: its tokens equal the chunked one's only if the rewind is exact (sampling
    at temperature 1 over the whole vocabulary: a generator one draw off gives other tokens)."""
    body = seeded(0, 3000, 8)
    body["stream"] = False
    r = client.post(GEN, json=body)
    assert r.status_code == 200, r.text
    chunked = r.json()["choices"][0]["token_ids"]
    assert len(chunked) == 8
    hits = metric_value(client.get("/metrics").text, "vllm:prefix_cache_hits_total") or 0.0
    again = client.post(GEN, json=body).json()["choices"][0]["token_ids"]
    assert (metric_value(client.get("/metrics").text, "vllm:prefix_cache_hits_total") or 0.0) - hits >= 2944
    assert again == chunked
    other_seed = {**body, "sampling_params": {**body["sampling_params"], "seed": 7}}
    assert client.post(GEN, json=other_seed).json()["choices"][0]["token_ids"] != chunked  # the seed decides
    alive(client)


def test_seeded_requests_under_kv_pressure(client):
    """Eight seeded requests of 50 + 700 tokens need 6000 KV tokens of 5120: the scheduler preempts and
    recomputes them."""
    pre = metric_value(client.get("/metrics").text, "vllm:num_preemptions_total") or 0.0

    async def run() -> list:
        async with httpx.AsyncClient(base_url=client.base_url, timeout=600) as ac:
            firsts = [asyncio.Event() for _ in range(8)]
            return await asyncio.gather(*(_stream(ac, seeded(i, 50, 700), firsts[i]) for i in range(8)))

    results = asyncio.run(run())
    assert all(len(r["tokens"]) == 700 and r["finish"] == "length" for r in results)
    assert (metric_value(client.get("/metrics").text, "vllm:num_preemptions_total") or 0.0) > pre
    alive(client)


def test_seeded_requests_frozen_through_updates(client, root):
    """pause?mode=keep, update (preempts the frozen requests; their recompute, 8 x 300+ tokens, exceeds one step's
    default budget), resume; three times while eight seeded streams run. Every stream finishes in full, with
    contiguous version spans, and the engine lives."""
    dirs = [write_step(root / "run" / f"step_{k}", tiny_state_dict(200 + k, ROPE)) for k in (1, 2, 3)]

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=client.base_url, timeout=600) as ac:
            firsts = [asyncio.Event() for _ in range(8)]
            streams = [asyncio.ensure_future(_stream(ac, seeded(i, 300, 300), firsts[i])) for i in range(8)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 600)
            answers = []
            for d in dirs:
                assert (await ac.post("/pause", params={"mode": "keep"})).status_code == 200
                r = await ac.post("/update_weights", json={"weight_dir": str(d)})
                answers.append(r.status_code)
                assert (await ac.post("/resume")).status_code == 200
            return list(await asyncio.gather(*streams)), answers

    results, answers = asyncio.run(run())
    assert answers == [200, 200, 200]
    for r in results:
        assert len(r["tokens"]) == 300 and r["finish"] == "length"
        spans = r["spans"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == 300
        assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:], strict=False))
    alive(client)


def test_rotary_with_non_default_theta_survives_updates(client, server, root, fresh):
    """On rope_theta 1e6: output after an update equals transformers on the new weights, a reload gives
    back this server's fresh answers exactly, and the rotary cache stays bit-identical."""
    from tests.reference import Reference

    sd = tiny_state_dict(210, ROPE)
    d = write_step(root / "run" / "step_10", sd)
    (d / "config.json").write_text(json.dumps(ROPE))  # the reference model reads it; tito ignores it
    assert client.post("/update_weights", json={"weight_dir": str(d)}).status_code == 200
    ref = Reference(d)
    assert greedy(client) == [ref.greedy(p, 8)[0] for p in PROMPTS]
    assert client.post("/reload_weights").status_code == 200
    again = greedy_answer(client)
    assert again["tokens"] == fresh["tokens"] and again["logprobs"] == pytest.approx(fresh["logprobs"], abs=1e-5)
    log = server.log_text()
    digests = re.findall(r"rotary caches bit-identical before and after \((\w+)\)", log)
    assert len(digests) >= 5 and len(set(digests)) == 1, digests
    assert "Failed to load weights" not in log and "rotary caches CHANGED" not in log
