"""LoRA exactness on the real engine (fp32, the tiny model): prompt logprobs and base rows under multi-LoRA.

Two adapters are loaded on the shared LoRA server (``--max-loras 2``, so every slot holds one): ``attn`` (q_proj,
v_proj) and ``head`` (q_proj and ``lm_head``: vLLM wraps the logits processor for it). The reference is transformers +
PEFT on the same adapter directory; base requests are also checked against the shared server without
``--enable-lora``. Both vLLM bugs fixed in app/engine/vllm_patches.py make these tests fail without the fixes
(``TITO_VLLM_PATCHES=0`` in the server's environment): the engine dies, or base rows carry an adapter.

To make the batches mixed whatever the timing, two long decodes (one base, one on an adapter) run through every
request's prefill: each step then holds base rows, rows of both adapters, sampled rows and prompt rows together.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file

from tests.conftest import LORA_CONTEXT
from tests.helpers import ServerProcess, restore_server
from tests.reference import PeftReference
from tests.sweep import fire_answers, shapes
from tests.test_lora import make_weights, write_adapter

pytestmark = pytest.mark.engine

GEN = "/inference/v1/generate"
TOL = 1e-4
ADAPTERS = {"attn": ("q_proj", "v_proj"), "head": ("q_proj", "lm_head")}


@pytest.fixture(scope="module")
def server(lora_tito: ServerProcess) -> Iterator[ServerProcess]:
    yield lora_tito
    restore_server(lora_tito.url)


@pytest.fixture(scope="module")
def model_dir(server: ServerProcess) -> Path:
    """The LoRA server's model directory (the tiny model with a ``LORA_CONTEXT`` context): the references' base."""
    return Path(httpx.get(server.url + "/server_info").json()["model"]["path"])


@pytest.fixture(scope="module")
def loaded(server: ServerProcess, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[dict[str | None, PeftReference]]:
    """Both adapters loaded (every LoRA slot used); name → reference, ``None`` → the base model."""
    base = load_file(str(model_dir / "model.safetensors"))
    work = tmp_path_factory.mktemp("lora-exact")
    refs: dict[str | None, PeftReference] = {None: PeftReference(model_dir, None)}
    with httpx.Client(base_url=server.url, timeout=120.0) as c:
        for seed, (name, targets) in enumerate(ADAPTERS.items(), 21):
            path = write_adapter(work / name, make_weights(base, seed=seed, targets=targets))
            r = c.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            assert r.status_code == 200, r.text
            refs[name] = PeftReference(model_dir, path)
        try:
            yield refs
        finally:
            for name in ADAPTERS:
                c.post("/v1/unload_lora_adapter", json={"lora_name": name})


def _prompt(length: int, salt: int) -> list[int]:
    return [(i * 31 + salt * 7) % 500 + 5 for i in range(length)]


def _body(prompt: list[int], model: str | None, **sp: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"token_ids": prompt, "sampling_params": sp}
    if model is not None:
        body["model"] = model
    return body


def _prompt_lps(answer: dict[str, Any], prompt: list[int]) -> list[float]:
    plp = answer["prompt_logprobs"]
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None, str(plp)[:300]
    return [plp[i][str(t)]["logprob"] for i, t in enumerate(prompt) if i]


def _worst(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want)
    return max((abs(a - b) for a, b in zip(got, want, strict=True)), default=0.0)


async def _background(c: httpx.AsyncClient, model: str | None, started: asyncio.Event) -> None:
    """A long decode that shares every step of what follows; ended by cancelling (the server aborts it)."""
    body = _body(_prompt(9, 99), model, max_tokens=LORA_CONTEXT - 16, temperature=0, ignore_eos=True)
    async with c.stream("POST", GEN, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                started.set()


def _mixed(bodies: list[dict[str, Any]], url: str) -> list[dict[str, Any]]:
    """``bodies`` sent at once beside a base and an adapter decode; their answers (each a 200), in order."""
    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=url, timeout=600.0) as c:
            events = [asyncio.Event(), asyncio.Event()]
            bg = [asyncio.ensure_future(_background(c, m, e)) for m, e in zip((None, "attn"), events, strict=True)]
            try:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
                rs = await asyncio.gather(*(c.post(GEN, json=b) for b in bodies))
                for t in bg:
                    assert not t.done(), "a background decode ended early: the batch was not mixed"
            finally:
                for t in bg:
                    t.cancel()
                await asyncio.gather(*bg, return_exceptions=True)
        for r in rs:
            assert r.status_code == 200, r.text[:500]
        return [r.json() for r in rs]

    return asyncio.run(run())


def test_prompt_logprobs_exact_for_every_request_of_mixed_batches(server: ServerProcess, loaded, client) -> None:
    """Every request's prompt logprobs, through its own adapter (none for a base request), within 1e-4 of
    transformers + PEFT, in batches mixing both adapters and the base, n up to 4, prompt logprobs and sampling in the
    same steps, prompts up to the context length. Base requests also equal the server without --enable-lora.

    Upstream repro (vLLM 0.32, CPU; issues 16668, 17766, 51594), fileable as is::

        # pip install vllm (CPU build); any model with an lm_head LoRA, here Qwen3-0.6B + an adapter on lm_head
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        llm = LLM("Qwen/Qwen3-0.6B", enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32")
        lora = LoRARequest("head", 1, "/path/to/adapter_with_lm_head")
        sp = SamplingParams(max_tokens=2, prompt_logprobs=1, n=2, seed=0)
        llm.generate({"prompt_token_ids": list(range(100, 120))}, sp, lora_request=lora)
        # CPU: the EngineCore dies (einsum shape mismatch in bgmv_shrink: 19 prompt rows vs 2 sampler indices);
        # GPU: prompt logprobs computed with the step's per-request mapping, the lm_head delta applied to the wrong
        # rows or dropped. Expected: each prompt row through its request's adapter.
    """
    cases: list[tuple[str | None, int, int]] = []  # (model, prompt length, n)
    for i, model in enumerate((None, "attn", "head")):
        cases += [(model, 3, 1), (model, 17, 2 + i % 2 * 2), (model, 200, 4), (model, 61, 1)]
    long = LORA_CONTEXT - 4  # the context's length, less max_tokens
    cases += [(m, long, 1) for m in (None, "attn", "head")]
    bodies = [_body(_prompt(length, k), model, n=n, max_tokens=2, prompt_logprobs=1, logprobs=0, temperature=1.0,
                    seed=k) for k, (model, length, n) in enumerate(cases)]
    answers = _mixed(bodies, server.url)

    worst: dict[str | None, float] = {}
    for (model, _, n), body, ans in zip(cases, bodies, answers, strict=True):
        prompt = body["token_ids"]
        assert len(ans["choices"]) == n
        want = loaded[model].prompt_logprobs(prompt)
        err = _worst(_prompt_lps(ans, prompt), want)
        worst[model] = max(worst.get(model, 0.0), err)
        assert err <= TOL, f"{model or 'base'}: prompt of {len(prompt)}, n={n}: off by {err:.2e}"
    # The checks have power: the adapters move prompt logprobs well past the tolerance.
    p = _prompt(17, 1)
    for name in ADAPTERS:
        assert _worst(loaded[name].prompt_logprobs(p), loaded[None].prompt_logprobs(p)) > 100 * TOL
    print("worst |tito - transformers+PEFT| per model:", worst)

    # Base requests: the server without --enable-lora gives the same (its context is shorter: short prompts only).
    ctx = client.get("/server_info").json()["model"]["max_model_len"]
    for (model, length, _), body, ans in zip(cases, bodies, answers, strict=True):
        if model is None and length + 2 <= ctx:
            r = client.post(GEN, json=body)
            assert r.status_code == 200, r.text
            assert _worst(_prompt_lps(ans, body["token_ids"]), _prompt_lps(r.json(), body["token_ids"])) <= TOL
            assert [c["token_ids"] for c in ans["choices"]] == [c["token_ids"] for c in r.json()["choices"]]


def test_base_requests_stay_base_when_every_lora_slot_is_used(server: ServerProcess, loaded) -> None:
    """24 concurrent greedy requests (adapter attn, adapter head, base, in turn) with both LoRA slots filled: every
    one equals its own reference (measured before the fix: 0 of the 8 base requests gave the base model's tokens).

    Upstream repro (vLLM 0.32, CPU platform; fix proposed in pull request 48421), fileable as is::

        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        llm = LLM("Qwen/Qwen3-0.6B", enable_lora=True, max_loras=2, dtype="float32")
        a = LoRARequest("a", 1, "/path/to/adapter_a")
        b = LoRARequest("b", 2, "/path/to/adapter_b")
        prompts = [{"prompt_token_ids": [100 + i, 200, 300]} for i in range(6)]
        sp = SamplingParams(max_tokens=8, temperature=0)
        mixed = llm.generate(prompts, sp, lora_request=[a, b, None] * 2)
        alone = llm.generate(prompts[2::3], sp)
        assert [o.outputs[0].token_ids for o in mixed[2::3]] == [o.outputs[0].token_ids for o in alone]
        # fails on CPU: vllm/lora/ops/torch_ops/lora_ops.py gathers lora weights with the index -1 of a no-LoRA row,
        # which is the last slot (adapter b), so the base prompts run through adapter b. Triton skips -1 rows.
    """
    models = ["attn", "head", None] * 8
    bodies = [_body(_prompt(5 + k % 7, 50 + k), m, max_tokens=8, temperature=0, logprobs=0)
              for k, m in enumerate(models)]

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300.0) as c:
            rs = await asyncio.gather(*(c.post(GEN, json=b) for b in bodies))
        assert all(r.status_code == 200 for r in rs), [r.text[:200] for r in rs if r.status_code != 200]
        return [r.json() for r in rs]

    answers = asyncio.run(run())
    wrong = []
    for model, body, ans in zip(models, bodies, answers, strict=True):
        toks, lps = loaded[model].greedy(body["token_ids"], 8)
        ch = ans["choices"][0]
        got = [e["logprob"] for e in ch["logprobs"]["content"]]
        if ch["token_ids"] != toks or _worst(got, lps) > TOL:
            wrong.append((model, body["token_ids"], ch["token_ids"], toks))
    assert not wrong, f"{len(wrong)} of {len(bodies)} answers differ from their reference: {wrong[:4]}"


def test_trainer_shapes_with_adapters_equal_their_answers_alone(server: ServerProcess, loaded) -> None:
    """The trainer request-shape sweep (tests/sweep.py) with the adapters active: everything at once, beside each
    other, answers exactly what the same request gets alone (seeded or greedy shapes: the same tokens; prompt
    logprobs within 1e-4), and the engine lives."""
    for model in ("head", "attn"):
        bodies = shapes(model=model)
        together = fire_answers(server.url, bodies)
        for name, body in bodies.items():
            sp = body["sampling_params"]
            if body.get("stream") or ("seed" not in sp and sp.get("temperature", 1.0) != 0):
                continue  # unseeded sampling: no single answer to compare with
            alone = httpx.post(server.url + GEN, json=body, timeout=120.0)
            assert alone.status_code == 200, alone.text
            a, b = json.loads(together[name]), alone.json()
            assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]], name
            if "prompt_logprobs" in sp:
                ids = body["token_ids"]
                assert _worst(_prompt_lps(a, ids), _prompt_lps(b, ids)) <= TOL, name
                if body.get("model"):
                    want = loaded[body["model"]].prompt_logprobs(ids)
                    assert _worst(_prompt_lps(a, ids), want) <= TOL, name
