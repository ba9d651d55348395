"""A gRPC generate request on the token API's own path: what smg's ``VllmEngine`` (servicer.py) and vLLM's
``vllm.Inference`` (vllm_inference.py) share on the way in.

Each service maps its proto onto the token API's JSON body (the field names differ between the two protos); from there
the request takes the one path HTTP takes: ``GenerateRequest`` validation, ``AppState.admit``, ``check_prompt`` and
``build_sampling_params`` (app/engine/sampling.py). So bad input gets ``INVALID_ARGUMENT`` with the HTTP 400's words,
before the engine, and what neither proto can carry to a tokens-only server is refused here in one wording.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from app.core.protocol import ApiError, GenerateRequest, bad_request, validation_error
from app.engine.sampling import build_sampling_params, check_prompt

if TYPE_CHECKING:
    from app.engine.sampling import SamplingParams
    from app.server.state import AppState


def sent(pairs: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """The ``(key, value)`` pairs that were sent. proto3 scalars without presence read 0 / False / empty when unset;
    those mean "not sent" (vLLM's servicer reads them the same way), so they are left out and tito's defaults
    apply, as for an HTTP request that omits the key."""
    return {k: v for k, v in pairs if v}


def refuse_text_prompt(send: str) -> ApiError:
    """A text prompt; ``send``: the proto field the ids go in."""
    return bad_request(f"text prompts need a tokenizer, which this tokens-only server does not load; send {send}.",
                       "text")


def refuse_truncation(param: str) -> ApiError:
    return bad_request("truncate_prompt_tokens is not supported: tito never shortens a prompt.", param)


def refuse_media(param: str) -> ApiError:
    return bad_request("multimodal input is not taken over gRPC; send content_parts or features to "
                       "POST /inference/v1/generate (multimodal models only).", param)


def token_request(body: dict[str, Any]) -> GenerateRequest:
    """The token API's JSON body as its ``GenerateRequest`` (``ApiError(400)`` in HTTP's words)."""
    try:
        return GenerateRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


def admit(state: AppState, req: GenerateRequest) -> SamplingParams:
    """``req`` admitted (503 while draining or shutting down, as HTTP) and checked: the engine-ready params."""
    state.admit()
    check_prompt(req.token_ids, state.limits)
    return build_sampling_params(req, state.limits)
