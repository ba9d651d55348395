"""What `logprobs` hold under each of vLLM's ``--logprobs-mode``, checked against transformers on the same weights.

vLLM's sampler reports the sampled token's (and the top tokens') score from the logits as they were before
(``raw_*``) or after (``processed_*``) its processing: temperature, then top-k/top-p masking; ``*_logprobs`` are
log-softmaxed, ``*_logits`` are not. Prompt tokens skip the processing: their scores are the raw logits in a logits
mode and the raw logprobs otherwise (vLLM's ``_get_prompt_logprobs_dict``). Prime-RL runs with
``processed_logprobs``: the distribution it actually sampled from, the one its importance ratios need.
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import torch

from tests.reference import Reference

GEN = "/inference/v1/generate"
TEMPERATURE, TOP_K = 0.7, 5
PROMPT = [7, 81, 300, 12, 5, 44]


def expected_scores(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """The scores vLLM reports for a sampled position (one row of raw logits) under ``mode``."""
    if mode.startswith("raw"):
        row = logits
    else:
        kth = torch.topk(logits, TOP_K).values[-1]
        row = torch.where(logits >= kth, logits / TEMPERATURE, torch.tensor(-math.inf))
    return row if mode.endswith("logits") else torch.log_softmax(row, dim=-1)


def check_logprobs_mode(client: httpx.Client, model_dir: str, mode: str, model: str | None = None) -> dict[str, Any]:
    """One sampled request (temperature 0.7, top-k 5, its two top tokens, prompt scores) against transformers."""
    body: dict[str, Any] = {"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 6, "temperature": TEMPERATURE, "top_k": TOP_K, "seed": 11, "logprobs": 2, "prompt_logprobs": 1}}
    if model is not None:
        body["model"] = model
    r = client.post(GEN, json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    choice = answer["choices"][0]
    tokens = choice["token_ids"]
    logits = Reference(model_dir).logits(PROMPT + tokens)
    worst = 0.0
    for i, (tok, entry) in enumerate(zip(tokens, choice["logprobs"]["content"], strict=True)):
        scores = expected_scores(logits[len(PROMPT) - 1 + i], mode)
        assert entry["token_id"] == tok
        worst = max(worst, abs(entry["logprob"] - float(scores[tok])))
        for top in entry["top_logprobs"]:
            worst = max(worst, abs(top["logprob"] - float(scores[top["token_id"]])))
    for i, row in enumerate(answer["prompt_logprobs"][1:], start=1):
        raw = logits[i - 1] if mode.endswith("logits") else torch.log_softmax(logits[i - 1], dim=-1)
        worst = max(worst, abs(row[str(PROMPT[i])]["logprob"] - float(raw[PROMPT[i]])))
    assert worst < 1e-4, f"{mode}: off by {worst} from transformers"
    return answer
