"""LoRA adapters: load, reload in place, unload; selected per request by ``"model": "<lora_name>"``.

- ``POST /load_lora_adapter`` (Prime-RL's route): load, or reload the same name in place keeping its ``lora_int_id``.
- ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter``: vLLM's semantics and answers.
- ``GET /lora_adapters``: the registry, including the ``LoRARequest`` that generation sends.

The in-place flag is sent to the engine only on the reload call itself. The registry keeps no flag and
``AppState.resolve_model`` builds every generation's ``LoRARequest`` with ``load_inplace=False``: a request carrying
the flag makes vLLM re-read the adapter from disk on every scheduler step (Prime-RL issue #3356).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import PlainTextResponse, Response

from app.engine import wait_or_timeout
from app.lora import validate_adapter
from app.metrics import LORA_LOAD_SECONDS, LORA_LOADS
from app.paths import resolve_allowed
from app.protocol import ApiError, json_response
from app.state import AppState, LoraEntry, get_state

log = logging.getLogger("tito.lora")
router = APIRouter(tags=["lora"])

# Loading an adapter reads it from disk inside the EngineCore; generous, but never unbounded.
ENGINE_TIMEOUT = 300.0
LOCK_TIMEOUT = ENGINE_TIMEOUT + 30.0


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


def _require_lora(state: AppState) -> None:
    if not state.facts.enable_lora:
        raise ApiError(400, "LoRA is not enabled on this server; start tito with --enable-lora "
                            "(and --max-lora-rank/--max-loras).")
    state.check_engine()


@asynccontextmanager
async def _exclusive(state: AppState) -> AsyncIterator[None]:
    try:
        await asyncio.wait_for(state.lora_lock.acquire(), LOCK_TIMEOUT)
    except TimeoutError:
        raise ApiError(503, f"another LoRA adapter operation has held the lock for over {LOCK_TIMEOUT:g}s; "
                            "try again later.", headers={"Retry-After": "10"}) from None
    try:
        yield
    finally:
        state.lora_lock.release()


def _engine_refusal(state: AppState, name: str, e: BaseException) -> ApiError:
    if isinstance(e, TimeoutError):
        return ApiError(504, f"the engine did not finish loading LoRA adapter '{name}' within {ENGINE_TIMEOUT:g}s; "
                             "its state is unknown, load it again.")
    if state.engine.errored:
        return ApiError(503, f"engine is dead: {e}")
    # The adapter passed tito's checks, so what is left is the engine's own refusal (e.g. a module vLLM cannot
    # put LoRA on, such as lm_head); the engine keeps serving.
    msg = str(e).removeprefix("Call to add_lora method failed: ")
    return ApiError(400, f"the engine refused LoRA adapter '{name}': {msg}", param="lora_path")


async def load_adapter(state: AppState, name: str, raw_path: str, *, inplace: bool) -> LoraEntry:
    """Validate then load (or, with ``inplace``, reload under the same id) an adapter; returns the registry entry."""
    from vllm.lora.request import LoRARequest

    _require_lora(state)
    if not name or not raw_path:
        raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.")
    if name in (state.facts.name, state.facts.path):
        raise ApiError(400, f"The lora adapter '{name}' conflicts with a served base model.", param="lora_name")
    path = resolve_allowed(state.settings, raw_path, "lora_path")

    async with _exclusive(state):
        existing = state.loras.get(name)
        if existing is not None and not inplace:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                                "in place, set 'load_inplace' to True.", param="lora_name")
        kind = "reload" if existing is not None else "load"
        t0 = time.monotonic()
        try:
            info = await asyncio.to_thread(validate_adapter, path, max_rank=state.facts.max_lora_rank,
                                           model_dir=state.settings.model)
            if existing is not None:
                int_id = existing.int_id
            else:
                int_id, state.next_lora_id = state.next_lora_id, state.next_lora_id + 1
            # load_inplace only on this call: it makes the engine replace the cached weights of int_id.
            request = LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=str(path),
                                  load_inplace=existing is not None)
            try:
                await wait_or_timeout(state.engine.add_lora(request), ENGINE_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - every engine failure becomes a clear answer
                raise _engine_refusal(state, name, e) from None
        except Exception as e:
            LORA_LOADS.labels(kind, "error").inc()
            log.warning("LoRA adapter %s '%s' from %s failed after %.2fs: %s", kind, name, path,
                        time.monotonic() - t0, e.message if isinstance(e, ApiError) else repr(e))
            raise

        if existing is not None and existing.path == str(path):
            # Prefix-cache blocks are keyed by adapter name and path, so a same-path reload would reuse KV computed
            # with the old weights.
            if not await wait_or_timeout(state.engine.reset_prefix_cache(), ENGINE_TIMEOUT):
                log.warning("LoRA adapter '%s' reloaded from the same path but the prefix cache could not be reset "
                            "(requests running); cached prefixes may reflect the old weights", name)
        entry = LoraEntry(name=name, int_id=int_id, path=str(path), loaded_at=time.time(), rank=info.rank,
                          alpha=info.alpha, target_modules=info.target_modules,
                          reloads=existing.reloads + 1 if existing is not None else 0)
        state.loras[name] = entry
        seconds = time.monotonic() - t0
        LORA_LOADS.labels(kind, "ok").inc()
        LORA_LOAD_SECONDS.observe(seconds)
        log.info("LoRA adapter %s '%s' (id %d, rank %d, %d modules) from %s in %.2fs", kind, name, int_id,
                 info.rank, info.modules, path, seconds)
        return entry


async def unload_adapter(state: AppState, name: str) -> None:
    _require_lora(state)
    if not name:
        raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
    async with _exclusive(state):
        entry = state.loras.pop(name, None)
        if entry is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
        # From here no new request can select it. Free it in the engine only when nothing is in flight: an in-flight
        # request still using it would make the engine re-read it from disk, which may be gone by then. Otherwise
        # the engine's LRU cache (--max-cpu-loras) evicts it later; ids are never reused.
        freed = False
        if state.inflight == 0:
            try:
                freed = await wait_or_timeout(state.engine.remove_lora(entry.int_id), ENGINE_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - the adapter is unloaded from the registry either way
                log.warning("engine could not drop LoRA adapter '%s' (id %d): %s", name, entry.int_id, e)
        LORA_LOADS.labels("unload", "ok").inc()
        log.info("LoRA adapter unload '%s' (id %d)%s", name, entry.int_id,
                 "" if freed else "; the engine's cache evicts it later")


@router.post("/load_lora_adapter", summary="Load, or reload in place under the same name (Prime-RL)")
async def load_lora_adapter_inplace(body: LoadLoraRequest, state: AppState = Depends(get_state)) -> Response:
    await load_adapter(state, body.lora_name, body.lora_path, inplace=True)
    return json_response({"status": "ok"})


@router.post("/v1/load_lora_adapter", summary="Load a LoRA adapter (vLLM semantics)",
             response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraRequest, state: AppState = Depends(get_state)) -> Response:
    await load_adapter(state, body.lora_name, body.lora_path, inplace=body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", summary="Unload a LoRA adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraRequest, state: AppState = Depends(get_state)) -> Response:
    await unload_adapter(state, body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _view(state: AppState, e: LoraEntry) -> dict[str, object]:
    req = state.resolve_model(e.name)
    sent = {} if req is None else {"lora_name": req.lora_name, "lora_int_id": req.lora_int_id,
                                   "lora_path": req.lora_path, "load_inplace": req.load_inplace}
    return {"lora_name": e.name, "lora_int_id": e.int_id, "lora_path": e.path, "rank": e.rank, "alpha": e.alpha,
            "target_modules": e.target_modules, "loaded_at": e.loaded_at, "reloads": e.reloads,
            # What generation sends to the engine for this adapter: must never carry load_inplace.
            "request": sent}


@router.get("/lora_adapters", summary="Loaded LoRA adapters and the request generation sends for each")
async def lora_adapters(state: AppState = Depends(get_state)) -> Response:
    return json_response({"enabled": state.facts.enable_lora, "max_lora_rank": state.facts.max_lora_rank,
                          "max_loras": state.facts.max_loras,
                          "data": [_view(state, e) for e in state.loras.values()]})
