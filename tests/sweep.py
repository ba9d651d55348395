"""The request shapes real RL trainers send (Prime-RL, TRL, SkyRL), fired at one server all at once: every answer is
a 200 (or the 400 the server's configuration documents for that shape), and the engine serves afterwards.

Why: a valid request (SkyRL's ``sample`` with prompt logprobs) killed the engine of a LoRA server, and so did an
n=1 prompt-logprobs request next to any unrelated one. Which batches a server builds depends on what arrives
together, so the shapes go out concurrently, beside a long decode that shares their engine steps. Each module that
owns a server configuration (LoRA, data parallel, a VLM, KV events) runs this on it; a few seconds each.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

GEN = "/inference/v1/generate"
PROMPT = [3, 1, 5, 9, 2, 6, 5, 3, 5, 8]  # no id a tiny model treats specially (4: the tiny VLM's <image>)


def shapes(prompt: list[int] = PROMPT, model: str | None = None) -> dict[str, dict[str, Any]]:
    """Name → request body. ``model``: an adapter name some shapes pick (as Prime-RL and SkyRL send it)."""
    def body(sp: dict[str, Any], ids: list[int] = prompt, **top: Any) -> dict[str, Any]:
        return {"token_ids": ids, "sampling_params": sp, **top}

    named: dict[str, Any] = {"model": model} if model else {}
    return {
        # Beside everything else: the unrelated decode that prompt-logprobs requests once killed the engine next to.
        "long_decode": body({"max_tokens": 48, "ignore_eos": True, "temperature": 1.0, "seed": 1}),
        # SkyRL 0.4 RemoteInferenceClient.sample (once fatal on a LoRA server): n samples, logprobs 0, prompt logprobs.
        "skyrl_sample": body({"n": 2, "max_tokens": 4, "prompt_logprobs": 2, "seed": 8, "logprobs": 0,
                              "output_kind": 2, "temperature": 1.0, "top_k": -1, "top_p": 1.0}, **named),
        # Scoring a sequence (reference/old logprobs): one token, the prompt's logprobs.
        "score": body({"max_tokens": 1, "prompt_logprobs": 0, "logprobs": 1, "temperature": 1.0}),
        # A two-token prompt: one prompt-logprob row (the other failure shape of the same bug).
        "score_short": body({"max_tokens": 2, "prompt_logprobs": 1}, prompt[:2]),
        # TRL GRPO: a group of num_generations, its sampling knobs, completion logprobs.
        "trl_group": body({"n": 4, "temperature": 0.9, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                           "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": 0}),
        # Prime-RL: one sample per request, cache salt inside sampling_params, LoRA by name, token ids back.
        "prime_rl": body({"max_tokens": 12, "temperature": 1.0, "top_p": 1.0, "logprobs": 1, "seed": 7,
                          "cache_salt": "step-3", "skip_special_tokens": False, "min_tokens": 1,
                          "repetition_penalty": 1.0}, return_token_ids=True, **named),
        # SkyRL generate: seeded group with stop ids, top logprobs.
        "seeded_stops": body({"n": 3, "seed": 1234, "temperature": 0.8, "logprobs": 2, "max_tokens": 10,
                              "stop_token_ids": [2, 7, 11]}, **named),
        "greedy_penalties": body({"temperature": 0, "max_tokens": 8, "presence_penalty": 0.5,
                                  "frequency_penalty": 0.5, "repetition_penalty": 1.1, "logit_bias": {"5": -5.0},
                                  "min_tokens": 2}),
        "stream_group": body({"n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": 1}, stream=True,
                             stream_options={"include_usage": True, "continuous_usage_stats": True}),
        "long_prompt": body({"n": 2, "max_tokens": 4, "logprobs": 1, "temperature": 1.0},
                            [(i * 37) % 500 + 5 for i in range(200)]),
    }


async def _send(c: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, str]:
    r = await c.post(GEN, json=body, headers=headers)
    return r.status_code, r.text


def _failure(name: str, status: int, text: str, refused: dict[str, str], stream: bool) -> str | None:
    if name in refused:
        ok = status == 400 and f'"param":"{refused[name]}"' in text
        return None if ok else f"{name}: expected a 400 on {refused[name]}, got {status} {text[:300]}"
    if status != 200:
        return f"{name}: {status} {text[:300]}"
    if stream and (not text.endswith("data: [DONE]\n\n") or '"error"' in text):
        return f"{name}: broken stream {text[-300:]}"
    return None


def fire(url: str, bodies: dict[str, dict[str, Any]], refused: dict[str, str] | None = None,
         headers: dict[str, dict[str, str]] | None = None, timeout: float = 120.0) -> dict[str, int]:
    """Send ``bodies`` concurrently; each must answer 200 (a stream: no error event), or for a name in ``refused``
    a 400 naming that param. Then the engine must be alive: ``/health`` 200 and a greedy generate served. ``headers``:
    per-shape request headers (a data-parallel rank). Returns the statuses by name."""
    return {name: status for name, (status, _) in _fire(url, bodies, refused, headers, timeout).items()}


def fire_answers(url: str, bodies: dict[str, dict[str, Any]], timeout: float = 120.0) -> dict[str, str]:
    """``fire`` (every shape a 200), returning the answers' bodies by name, to compare with a reference."""
    return {name: text for name, (_, text) in _fire(url, bodies, None, None, timeout).items()}


def _fire(url: str, bodies: dict[str, dict[str, Any]], refused: dict[str, str] | None,
          headers: dict[str, dict[str, str]] | None, timeout: float) -> dict[str, tuple[int, str]]:
    refused, headers = refused or {}, headers or {}

    async def run() -> tuple[list[tuple[int, str]], int, int]:
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as c:
            got = await asyncio.gather(*[_send(c, b, headers.get(n, {})) for n, b in bodies.items()])
            health = (await c.get("/health")).status_code
            after = await c.post(GEN, json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 3,
                                                                                      "temperature": 0}})
            return got, health, after.status_code

    got, health, after = asyncio.run(run())
    failures = [f for (name, body), (status, text) in zip(bodies.items(), got, strict=True)
                if (f := _failure(name, status, text, refused, bool(body.get("stream")))) is not None]
    assert health == 200 and after == 200, f"engine not serving after the sweep (health {health}, generate " \
                                           f"{after}); answers: {failures or 'all as expected'}"
    assert not failures, failures
    return dict(zip(bodies, got, strict=True))
