"""The bytes of the generate route's answers (routers/generate.py): vLLM 0.32's JSON shapes as plain dicts for orjson,
and the SSE event framing, with the byte template of a plain mid-stream event. No per-token models on the hot path.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import orjson

from app.engine.routed_experts import routed_experts_wire

if TYPE_CHECKING:
    from app.engine.adapter import CompletionOutput

_FLOOR = -9999.0


def _clamp(x: float) -> float:
    # -inf and NaN are not JSON; vLLM sends -9999.0 for both.
    return _FLOOR if math.isnan(x) or x < _FLOOR else x


def _token_entry(token_id: int, lp: Any) -> dict[str, Any]:
    # Both generations of clients: vLLM 0.32 reads token_id; renderers (Prime-RL) and vLLM <= 0.31 read
    # "token": "token_id:<id>" with bytes null.
    return {"token_id": token_id, "token": f"token_id:{token_id}", "logprob": _clamp(lp.logprob),
            "rank": lp.rank or None, "bytes": None}


def logprobs_content(token_ids: Any, top: Any, num: int) -> dict[str, Any]:
    content = []
    for i, tid in enumerate(token_ids):
        step = top[i] if top is not None and i < len(top) else None
        lp = step.get(tid) if step is not None else None
        if step is None or lp is None:
            content.append({"token_id": tid, "token": f"token_id:{tid}", "logprob": _FLOOR, "rank": None,
                            "bytes": None, "top_logprobs": []})
            continue
        entry = _token_entry(tid, lp)
        k = len(step) if num == -1 else max(num, 1)
        entry["top_logprobs"] = [_token_entry(t, v) for j, (t, v) in enumerate(step.items()) if j < k]
        content.append(entry)
    return {"content": content}


def prompt_logprobs_json(plp: Any) -> list[Any] | None:
    if plp is None:
        return None
    out: list[Any] = []
    for step in plp:
        if step is None:
            out.append(None)
        else:
            out.append({str(t): {"logprob": _clamp(v.logprob), "rank": v.rank, "decoded_token": None}
                        for t, v in step.items()})
    return out


def spans(output: CompletionOutput) -> list[dict[str, Any]] | None:
    wv = output.weight_versions
    if wv is None:
        return None
    return [{"version": s.version, "start": s.start, "end": s.end} for s in wv]


def sampling_mask(output: CompletionOutput) -> list[list[int]] | None:
    """vLLM's ``--return-sampling-mask``: per sampled token, the ids its processed distribution kept."""
    mask = getattr(output, "sampling_mask", None)
    return None if mask is None else [list(ids) for ids in mask.token_ids]


def choice(output: CompletionOutput, num_logprobs: int | None, *, final: bool,
           experts: tuple[int, str] = (0, "prime-rl")) -> dict[str, Any]:
    """One choice of an answer; ``experts``: the request's ``routed_experts_prompt_start`` and the server's
    ``--routed-experts-format``."""
    return {
        "index": output.index,
        "finish_reason": (output.finish_reason or "stop") if final else output.finish_reason,
        "stop_reason": output.stop_reason,
        "token_ids": list(output.token_ids),
        "routed_experts": routed_experts_wire(getattr(output, "routed_experts", None), *experts),
        "sampling_mask": sampling_mask(output),
        "weight_versions": spans(output),
        "logprobs": (logprobs_content(output.token_ids, output.logprobs, num_logprobs)
                     if num_logprobs is not None else None),
    }


def usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached} if cached is not None else None,
            "completion_tokens_details": None}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"
_IDS_MARK = b'"token_ids":[]'


def plain_event_parts(request_id: str, index: int) -> tuple[bytes, bytes]:
    """The bytes of a plain mid-stream event (tokens only: no finish, logprobs or usage; the bulk of a stream) before
    and after its token ids. Cut out of the general form built by ``choice``, so the two cannot differ."""
    blank = SimpleNamespace(index=index, finish_reason=None, stop_reason=None, token_ids=[], weight_versions=None,
                            logprobs=None)
    whole = sse({"request_id": request_id, "usage": None, "output_mode": "tokens",
                  "choices": [choice(blank, None, final=False)]})  # type: ignore[arg-type]
    head, mark, tail = whole.partition(_IDS_MARK)
    assert mark and _IDS_MARK not in tail
    return head + b'"token_ids":', tail


