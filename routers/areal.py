"""AReaL's routes (``RemotevLLMEngine``, areal/engine/vllm_remote.py), as thin entries into what tito already does.

- ``/areal_pause_generation`` = ``/pause?mode=abort`` (in-flight requests end with ``finish_reason: "abort"`` and
  their partial tokens; AReaL resubmits them), ``/areal_continue_generation`` = ``/resume``.
- ``/areal_update_weights {model_path}``: an in-place load of a checkpoint directory (``/update_weights``'s path).
- ``/areal_init_weights_update_group``, ``/areal_set_update_weight_meta``, ``/areal_update_weights_xccl`` and the
  LoRA variants: AReaL's broadcast weight sync (app/weights/areal.py).

Answers are AReaL's ``{"success": bool, "message": str}``; errors are tito's error envelope with a 4xx/5xx status.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from app.core.protocol import ERROR_RESPONSES, ApiError, json_response
from app.engine.engine_setup import on_cpu
from app.server.control_service import pause_generation, resume_generation
from app.server.state import AppState, get_state
from app.server.weight_service import disk_update
from app.weights.paths import resolve_allowed

router = APIRouter(tags=["areal"])
_TIMEOUT = 600.0  # s: waiting for earlier control calls (AReaL's own server has no bound)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class UpdateWeights(_Body):
    model_path: str = Field(max_length=4096)
    load_format: str | None = "auto"
    abort_all_requests: bool = False


class InitGroup(_Body):
    master_address: str = Field(min_length=1, max_length=256)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    backend: str
    group_name: str = Field(min_length=1, max_length=256)


class WeightMeta(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str


class LoraWeightMeta(WeightMeta):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
    lora_target_modules: list[str] | str
    lora_rank: int
    lora_alpha: float
    lora_bias: str = "none"
    base_model_name: str | None = None


def _ok(message: str, **extra: object) -> Response:
    return json_response({"success": True, "message": message, **extra})


@router.post("/areal_pause_generation", responses=ERROR_RESPONSES,
             summary="AReaL: abort in-flight requests and hold new ones (= /pause?mode=abort)")
async def areal_pause(state: AppState = Depends(get_state)) -> Response:
    await pause_generation(state, "abort", True, _TIMEOUT)
    return _ok("Generation paused and all requests aborted")


@router.post("/areal_continue_generation", responses=ERROR_RESPONSES, summary="AReaL: resume (= /resume)")
async def areal_continue(state: AppState = Depends(get_state)) -> Response:
    await resume_generation(state, _TIMEOUT)
    return _ok("Generation continued")


@router.post("/areal_update_weights", responses=ERROR_RESPONSES,
             summary="AReaL: load a checkpoint directory in place (= /update_weights {weight_dir})")
async def areal_update_weights(body: UpdateWeights, state: AppState = Depends(get_state)) -> Response:
    directory = resolve_allowed(state.settings, body.model_path, "model_path")
    state.check_engine()
    outcome = await disk_update(state, directory, None, "disk")
    return _ok("Success", **outcome.body())


@router.post("/areal_init_weights_update_group", responses=ERROR_RESPONSES,
             summary="AReaL: join the trainer's weight group (gloo on CPU, NCCL on GPU) as rank >= 1")
async def areal_init_group(body: InitGroup, state: AppState = Depends(get_state)) -> Response:
    if body.backend not in ("gloo", "nccl"):
        raise ApiError(400, f"backend must be gloo or nccl, got {body.backend!r}.", param="backend")
    if body.backend == "nccl" and on_cpu():
        raise ApiError(501, "the nccl backend needs a GPU; on CPU AReaL's weight group runs over gloo.",
                       param="backend")
    state.check_engine()
    results = await state.areal.join(body.master_address.strip("[]"), body.master_port, body.rank_offset,
                                     body.world_size, body.backend, body.group_name)
    return _ok("Success", ranks=sorted(int(r["rank"]) for r in results if isinstance(r, dict)))


@router.post("/areal_set_update_weight_meta", responses=ERROR_RESPONSES,
             summary="AReaL: announce the tensors the next broadcast carries (HF names)")
async def areal_set_meta(body: WeightMeta, state: AppState = Depends(get_state)) -> Response:
    await state.areal.set_meta(body.group_name, body.names, body.dtypes, body.shapes)
    return _ok("Success")


@router.post("/areal_update_weights_xccl", responses=ERROR_RESPONSES,
             summary="AReaL: receive the announced tensors (one broadcast each) and load them")
async def areal_update_xccl(state: AppState = Depends(get_state)) -> Response:
    state.check_engine()
    outcome = await state.areal.update()
    return _ok("Success", **outcome.body())


@router.post("/areal_set_update_weight_meta_lora", responses=ERROR_RESPONSES,
             summary="AReaL: announce the LoRA tensors (PEFT names) of the next broadcast")
async def areal_set_meta_lora(body: LoraWeightMeta, state: AppState = Depends(get_state)) -> Response:
    state.areal.set_meta_lora(body.group_name, body.names, body.dtypes, body.shapes,
                              {"lora_name": body.lora_name, "rank": body.lora_rank, "alpha": body.lora_alpha,
                               "target_modules": body.lora_target_modules, "bias": body.lora_bias,
                               "base_model_name": body.base_model_name})
    return _ok("Success")


@router.post("/areal_update_weights_lora_xccl", responses=ERROR_RESPONSES,
             summary="AReaL: receive the announced LoRA tensors and serve them under the versioned adapter name")
async def areal_update_lora_xccl(body: LoraWeightMeta, state: AppState = Depends(get_state)) -> Response:
    state.check_engine()
    meta = state.areal.meta
    if meta is not None and meta.lora is not None and meta.lora["lora_name"] != body.lora_name:
        raise ApiError(400, f"lora_name {body.lora_name!r} is not the announced {meta.lora['lora_name']!r}.",
                       param="lora_name")
    entry = await state.areal.update_lora()
    return _ok("Success", lora_name=entry.name, lora_int_id=entry.int_id)
