"""Router replay on a real engine: ``--enable-return-routed-experts`` on the CPU platform, on a tiny random Qwen3-MoE
(``app/tiny/moe.py``: 2 MoE layers, 8 experts, top 2, float32).

vLLM 0.32 captures routed experts only in its GPU Model Runner V2; tito's fix to its CPU runner
(app/engine/vllm_patches.py, "routed experts on CPU") drives vLLM's own capture and connector there. The ids tito
returns, decoded by Prime-RL's own client code (``renderers``' ``parse_generate_response`` and verifiers' decoding, as
tests/test_routed_experts_wire.py), equal transformers' router top-k (``Qwen3MoeSparseMoeBlock``'s gate logits from
``output_router_logits=True``, softmax, top-k) at every position and layer: prompt positions from the request's
``routed_experts_prompt_start`` and the generated ones (the last generated token never runs through the model, so
it has no row). The top-k is compared as a set per row: vLLM's CPU router takes it unsorted, and replay selects
experts by id. Without the fix (``TITO_VLLM_PATCHES=0``) the server does not start (tests/test_cli.py).
The last test updates the weights: without the fix for MoE weight updates on CPU (fix 6) the engine's tokens and
the second MoE layer's routing no longer match the new weights (measured before the fix).

The server's answers are in Prime-RL's form (the default ``--routed-experts-format``); vLLM's own base64 ``.npy``
form is read from the same engine through vLLM's ``/v1/completions`` (the same ``numpy2base64`` tito's ``npy``
setting sends; the setting itself: tests/test_routed_experts_wire.py), so one engine start serves both.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.tiny.moe import MOE_CONFIG, make_tiny_moe
from tests.conftest import SharedServers, module_server, start_tito
from tests.helpers import ServerProcess, restore_server
from tests.test_routed_experts_wire import verifiers_decode

pytestmark = pytest.mark.engine
GEN = "/inference/v1/generate"
TOP_K, LAYERS = MOE_CONFIG["num_experts_per_tok"], MOE_CONFIG["num_hidden_layers"]
# Prompts past one KV block (32 tokens): whole blocks of routing go through vLLM's block store as well as the tail.
PROMPTS = [[(7 * i + 3) % 500 + 3 for i in range(37)], [5, 17, 33, 100, 200, 7, 9, 11], list(range(40, 60))]


@module_server("moe")
def start_server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> ServerProcess:
    """The tiny MoE, eager, float32, 32 KV blocks of 32 tokens (the CPU default is 128: prompts of a few dozen tokens
    fill whole blocks, whose routing vLLM keeps in its block store): a cheap start. Chunked prefill on (tito's CPU
    default is off) with 32 tokens a step: a long prompt's routing is captured over several steps, the chunks that
    sample no token included."""
    model = make_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe")
    return start_tito(tmp_path_factory, model, "--enable-return-routed-experts", "--enforce-eager",
                      "--max-model-len", "256", "--block-size", "32", "--num-kv-blocks", "32",
                      "--enable-chunked-prefill", "--max-num-batched-tokens", "32", name="moe")


@pytest.fixture(scope="module")
def client(shared_servers: SharedServers) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared_servers.get("moe").url, timeout=300.0) as c:
        yield c


@pytest.fixture(scope="module")
def model(shared_servers: SharedServers) -> str:
    """The served model's directory (also its served name)."""
    cmd = shared_servers.get("moe").cmd
    return cmd[cmd.index("--model") + 1]


@pytest.fixture(scope="module")
def hf_model(model: str) -> Any:
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def reference(model: Any, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    """transformers on ``tokens``: each position's router top-k per MoE layer, ``[positions, layers, top_k]`` (sorted
    ids), and the greedy next token after each position."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    for logits in out.router_logits:  # a near-tie would make the comparison a coin flip between two float32 forwards
        top = logits.float().sort(dim=-1, descending=True).values
        assert float((top[:, TOP_K - 1] - top[:, TOP_K]).min()) > 1e-4
    probs = [torch.softmax(logits.float(), dim=-1) for logits in out.router_logits]  # [positions, experts] per layer
    ids = torch.stack([p.topk(TOP_K, dim=-1).indices for p in probs], dim=1)
    return ids.sort(dim=-1).values.numpy(), out.logits[0].argmax(-1).tolist()


def generate(client: httpx.Client, prompt: list[int], start: int, max_tokens: int = 8) -> dict[str, Any]:
    from renderers.client import parse_generate_response

    body = {"token_ids": prompt,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "routed_experts_prompt_start": start}}
    r = client.post(GEN, json=body)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = parse_generate_response(r.content)
    return answer


def check(model: Any, prompt: list[int], start: int, choice: dict[str, Any]) -> np.ndarray:
    """The answer's routed experts are transformers' router top-k from ``start`` on, its tokens transformers'
    greedy ones; returns the decoded ids."""
    tokens = choice["token_ids"]
    payload = choice["routed_experts"]
    assert payload["start"] == start and payload["dtype"] == "uint8"
    got = verifiers_decode(payload)
    seq = prompt + tokens
    assert got.shape == (len(seq) - 1 - start, LAYERS, TOP_K)
    want, greedy = reference(model, seq[:-1])
    assert tokens == greedy[len(prompt) - 1:], "the engine and transformers disagree on the model"
    np.testing.assert_array_equal(np.sort(got, axis=-1), want[start:])
    return got


@pytest.mark.parametrize("start", [0, 5])
def test_routed_experts_are_the_routers_top_k(client: httpx.Client, hf_model: Any, start: int) -> None:
    """Three prompts at once (sharing steps, the longest prefilled in two chunks), every prompt and generated
    position, both MoE layers; ``routed_experts_prompt_start`` drops the rows before it."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: generate(client, p, start), PROMPTS))
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        check(hf_model, prompt, start, answer["choices"][0])


def test_prefix_cache_hit_returns_the_stored_routing(client: httpx.Client, hf_model: Any) -> None:
    """A prompt whose first blocks are in the prefix cache is not run through the model again: their routing comes
    from vLLM's block store, and still equals the router's; after a prefix-cache reset (what a weight update may do)
    the prompt runs again, and so does its capture."""
    prompt = [(11 * i + 2) % 500 + 3 for i in range(70)]
    first = generate(client, prompt, 0, max_tokens=4)
    again = generate(client, prompt, 0, max_tokens=4)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64, again["usage"]
    a = check(hf_model, prompt, 0, first["choices"][0])
    np.testing.assert_array_equal(a, check(hf_model, prompt, 0, again["choices"][0]))
    r = client.post("/reset_prefix_cache")
    assert r.status_code == 200, r.text
    reset = generate(client, prompt, 0, max_tokens=4)
    assert reset["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, reset["usage"]
    np.testing.assert_array_equal(a, check(hf_model, prompt, 0, reset["choices"][0]))


def test_served_and_checked(client: httpx.Client) -> None:
    """``/server_info`` says so; a ``routed_experts_prompt_start`` past the prompt is a 400 (vLLM's check) and the
    engine keeps serving."""
    assert client.get("/server_info").json()["features"]["routed_experts"] is True
    r = client.post(GEN, json={"token_ids": PROMPTS[1], "sampling_params": {"max_tokens": 2,
                                                                             "routed_experts_prompt_start": 9}})
    assert r.status_code == 400 and "routed_experts_prompt_start" in r.text, r.text
    assert verifiers_decode(generate(client, PROMPTS[1], 8, max_tokens=3)["choices"][0]["routed_experts"]).shape \
        == (2, LAYERS, TOP_K)


def test_vllm_npy_form(client: httpx.Client, model: str, hf_model: Any) -> None:
    """vLLM's own form of the same capture (base64 of the array's ``.npy`` bytes, ``[positions, layers, top_k]``),
    as vLLM's ``/v1/completions`` on this engine sends it."""
    prompt = PROMPTS[1]
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                             "max_tokens": 6, "temperature": 0, "routed_experts_prompt_start": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    got = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)
    ours = generate(client, prompt, 2, max_tokens=6)["choices"][0]
    seq = prompt + ours["token_ids"]
    assert got.dtype == np.uint8 and got.shape == (len(seq) - 1 - 2, LAYERS, TOP_K)
    np.testing.assert_array_equal(got, verifiers_decode(ours["routed_experts"]))
    np.testing.assert_array_equal(np.sort(got, axis=-1), reference(hf_model, seq[:-1])[0][2:])


def test_routing_follows_a_weight_update(client: httpx.Client, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Router replay across RL steps: after a weight update (another draw of every tensor, the router's included)
    the ids are the new router's. The base weights are put back at the end."""
    import transformers

    step = make_tiny_moe(tmp_path_factory.mktemp("moe-step") / "step-1", seed=99)
    r = client.post("/update_weights", json={"weight_dir": str(step)})
    assert r.status_code == 200, r.text
    try:
        new = transformers.AutoModelForCausalLM.from_pretrained(step).eval()
        for prompt in PROMPTS[:2]:
            check(new, prompt, 0, generate(client, prompt, 0)["choices"][0])
    finally:
        restore_server(str(client.base_url))
