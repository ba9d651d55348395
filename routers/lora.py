"""LoRA adapters over HTTP: load, reload in place, unload; selected per request by ``"model": "<lora_name>"``.

- ``POST /load_lora_adapter`` (Prime-RL's route): load, or reload the same name in place keeping its ``lora_int_id``.
- ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter``: vLLM's semantics and answers.
- ``GET /lora_adapters``: the registry, including the request generation sends for each adapter.

The orchestration (validation, the lock, ids, the engine calls) is ``app.weights.lora.LoraManager``.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import PlainTextResponse, Response

from app.core.protocol import json_response
from app.server.state import AppState, get_state

router = APIRouter(tags=["lora"])


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(max_length=256)
    lora_path: str = Field(max_length=4096)
    load_inplace: bool = False
    # vLLM consults it only with enable_mixed_moe_lora_format, which tito does not expose; accepted and ignored.
    is_3d_lora_weight: bool = False


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(max_length=256)
    lora_int_id: int | None = None


@router.post("/load_lora_adapter", summary="Load, or reload in place under the same name (Prime-RL)")
async def load_lora_adapter_inplace(body: LoadLoraRequest, state: AppState = Depends(get_state)) -> Response:
    await state.adapters.load(body.lora_name, body.lora_path, inplace=True)
    return json_response({"status": "ok"})


@router.post("/v1/load_lora_adapter", summary="Load a LoRA adapter (vLLM semantics)",
             response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraRequest, state: AppState = Depends(get_state)) -> Response:
    await state.adapters.load(body.lora_name, body.lora_path, inplace=body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", summary="Unload a LoRA adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraRequest, state: AppState = Depends(get_state)) -> Response:
    await state.adapters.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@router.get("/lora_adapters", summary="Loaded LoRA adapters and the request generation sends for each")
async def lora_adapters(state: AppState = Depends(get_state)) -> Response:
    f = state.facts
    return json_response({"enabled": f.enable_lora, "max_lora_rank": f.max_lora_rank, "max_loras": f.max_loras,
                          "data": [state.adapters.view(e) for e in state.loras.values()]})
