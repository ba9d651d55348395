"""vLLM's native ``vllm.Control`` service (``proto/vllm_control.proto``) on tito's ``AppState``: how Dynamo's vLLM
sidecar discovers the served model and drives engine control, LoRA and weight-version calls.

Every call maps onto what tito's HTTP admin routes already do, through the same service layer: pause / resume
(``app/server/control_service.py``) go through the control plane's one-at-a-time queue (``app/server/control.py``),
LoRA loads through the adapter registry and its path allow-list (``app/weights/lora.py``: a ``source_path`` outside
it is PERMISSION_DENIED), the native weight-transfer calls through ``app/server/weight_service.py`` (UNIMPLEMENTED on
CPU, as HTTP answers 501), ``Shutdown`` is tito's SIGTERM drain.
``GetServerInfo`` / ``GetModelInfo`` are built once: the sidecar requires identical answers on every connection.
Sleep mode is not offered (``sleep_mode_enabled`` false): Sleep / WakeUp are UNIMPLEMENTED, IsSleeping says false.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from app.core.protocol import ApiError, bad_request
from app.grpc.proto import vllm_control_pb2 as pb
from app.grpc.proto import vllm_control_pb2_grpc as pb_grpc
from app.grpc.status import GrpcCall, fail
from app.server import control_service, weight_service
from app.server.state import AppState

log = logging.getLogger("tito.grpc")
T = TypeVar("T")

API_VERSION = "vllm"
PAUSE_TIMEOUT_S = 300.0  # the HTTP routes' defaults
RESUME_TIMEOUT_S = 600.0
SHUTDOWN_DELAY_S = 0.1  # the answer leaves before the signal
_MODES = {pb.PAUSE_MODE_UNSPECIFIED: "abort", pb.PAUSE_MODE_ABORT: "abort", pb.PAUSE_MODE_WAIT: "wait",
          pb.PAUSE_MODE_KEEP: "keep"}


def server_info(state: AppState) -> pb.ServerInfo:
    from app.engine.adapter import vllm_version

    f, eng = state.facts, state.engine
    backend = eng.weight_transfer_backend
    return pb.ServerInfo(
        engine_version=vllm_version(), api_version=API_VERSION, instance_id=f"tito-{uuid.uuid4().hex}",
        parallelism=pb.ParallelismInfo(
            tensor_parallel_size=f.tensor_parallel_size, pipeline_parallel_size=f.pipeline_parallel_size,
            data_parallel_size=f.data_parallel_size, data_parallel_rank=0, decode_context_parallel_size=1,
            world_size=eng.world_size(include_dp=False), data_parallel_size_local=f.data_parallel_size),
        max_model_len=f.max_model_len, kv_block_size=f.kv_block_size,
        # Over every local engine core: the sidecar divides by the local data-parallel size.
        total_kv_blocks=f.num_kv_blocks * f.data_parallel_size, max_running_requests=f.max_num_seqs,
        max_batched_tokens=f.max_num_batched_tokens, max_loras=f.max_loras if f.enable_lora else 0,
        rl_capabilities=pb.RlCapabilities(weight_transfer_enabled=backend is not None,
                                          weight_transfer_backend=backend or "", sleep_mode_enabled=False,
                                          draft_weight_updates_enabled=False),
        effective_attention_block_size=f.kv_block_size)


def model_info(state: AppState) -> pb.ModelInfo:
    f = state.facts
    # The sidecar reads the model's config and tokenizer files from this directory, on its own disk.
    return pb.ModelInfo(model_id=os.path.abspath(f.path), served_model_name=f.name, supports_text_input=False,
                        supports_token_ids_input=True, supports_lora=f.enable_lora, supports_multimodal=False)


class Refused(Exception):
    """A refusal with a status no HTTP status maps to (ALREADY_EXISTS)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _json_object(raw: bytes, name: str) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"null")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be a JSON object.", name)
    return value


def _source_path(raw: str) -> str:
    # Dynamo's load_lora route takes a file:// URI; other callers send a plain path.
    return raw.removeprefix("file://") if raw.startswith("file:///") else raw


class ControlServicer(pb_grpc.ControlServicer):
    def __init__(self, state: AppState) -> None:
        self.state = state

    @functools.cached_property
    def server(self) -> pb.ServerInfo:
        return server_info(self.state)  # once: the sidecar requires the same answer on every connection

    @functools.cached_property
    def model(self) -> pb.ModelInfo:
        return model_info(self.state)

    async def _answer(self, context: grpc.aio.ServicerContext, method: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn``, count the call, and end it with the status of an ``ApiError`` (an unexpected failure is
        INTERNAL, or UNAVAILABLE when the engine is dead)."""
        call = GrpcCall(method)
        try:
            out = await fn()
        except ApiError as e:
            await fail(context, call, e)
        except Refused as e:
            call.done(e.code)
            await context.abort(e.code, str(e))
        except Exception as e:  # noqa: BLE001 - a status with a message, never a stack trace
            await fail(context, call, self.state.engine_error(e, method))
        call.done(grpc.StatusCode.OK)
        return out

    # ------------------------------------------------------------------ discovery

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> pb.ServerInfo:
        GrpcCall("GetServerInfo").done(grpc.StatusCode.OK)
        return self.server

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        GrpcCall("GetModelInfo").done(grpc.StatusCode.OK)
        return self.model

    async def GetKvEventSources(self, request: pb.GetKvEventSourcesRequest,  # noqa: N802
                                context: grpc.aio.ServicerContext) -> pb.GetKvEventSourcesResponse:
        out = pb.GetKvEventSourcesResponse()
        for src in self.state.engine.kv_event_sources():
            out.sources.add(transport="zmq", endpoint=src["endpoint"], topic=src["topic"],
                            replay_endpoint=src["replay_endpoint"], data_parallel_rank=src["rank"],
                            encoding="msgpack", buffer_steps=src["buffer_steps"], hwm=src["hwm"],
                            max_queue_size=src["max_queue_size"])
        GrpcCall("GetKvEventSources").done(grpc.StatusCode.OK)
        return out

    # ------------------------------------------------------------------ requests and lifecycle

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:  # noqa: N802
        # By the ids callers gave their requests; an unknown or finished id is not an error (the sidecar aborts
        # every request its client left, finished or not).
        ids = [i for i in request.request_ids if i]
        n = await self.state.abort(ids) if ids else 0
        if n:
            log.info("gRPC Abort %s: %d request(s) hit", ids, n)
        GrpcCall("Abort").done(grpc.StatusCode.OK)
        return pb.AbortResponse()

    async def Shutdown(self, request: pb.ShutdownRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.ShutdownResponse:
        log.warning("gRPC Shutdown: draining and exiting, as on SIGTERM")
        asyncio.get_running_loop().call_later(SHUTDOWN_DELAY_S, os.kill, os.getpid(), signal.SIGTERM)
        GrpcCall("Shutdown").done(grpc.StatusCode.OK)
        return pb.ShutdownResponse()

    # ------------------------------------------------------------------ LoRA

    @staticmethod
    def _adapter(entry: Any) -> pb.LoraAdapter:
        return pb.LoraAdapter(lora_id=entry.int_id, lora_name=entry.name, source_path=entry.path)

    async def LoadLora(self, request: pb.LoadLoraRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.LoadLoraResponse:
        async def load() -> pb.LoadLoraResponse:
            if request.lora_name in self.state.loras:
                raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"LoRA adapter '{request.lora_name}' is already "
                              "loaded; unload it first (tito reloads in place only over HTTP /load_lora_adapter).")
            entry = await self.state.adapters.load(request.lora_name, _source_path(request.source_path),
                                                   inplace=False)
            return pb.LoadLoraResponse(adapter=self._adapter(entry))

        return await self._answer(context, "LoadLora", load)

    async def UnloadLora(self, request: pb.UnloadLoraRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> pb.UnloadLoraResponse:
        async def unload() -> pb.UnloadLoraResponse:
            entry = self.state.adapters.resolve(request.lora_name) if request.lora_name else None
            await self.state.adapters.unload(request.lora_name)
            return pb.UnloadLoraResponse(adapter=self._adapter(entry))

        return await self._answer(context, "UnloadLora", unload)

    async def ListLoras(self, request: pb.ListLorasRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> pb.ListLorasResponse:
        GrpcCall("ListLoras").done(grpc.StatusCode.OK)
        return pb.ListLorasResponse(adapters=[self._adapter(e) for e in self.state.loras.values()])

    # ------------------------------------------------------------------ generation control

    async def PauseGeneration(self, request: pb.PauseGenerationRequest,  # noqa: N802
                              context: grpc.aio.ServicerContext) -> pb.PauseGenerationResponse:
        async def pause() -> pb.PauseGenerationResponse:
            mode = _MODES.get(request.mode)
            if mode is None:
                raise bad_request(f"unknown pause mode {request.mode}.", "mode")
            clear = request.clear_cache if request.HasField("clear_cache") else True
            await control_service.pause_generation(self.state, mode, clear, PAUSE_TIMEOUT_S)
            return pb.PauseGenerationResponse()

        return await self._answer(context, "PauseGeneration", pause)

    async def ResumeGeneration(self, request: pb.ResumeGenerationRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext) -> pb.ResumeGenerationResponse:
        async def resume() -> pb.ResumeGenerationResponse:
            await control_service.resume_generation(self.state, RESUME_TIMEOUT_S)
            return pb.ResumeGenerationResponse()

        return await self._answer(context, "ResumeGeneration", resume)

    async def IsPaused(self, request: pb.IsPausedRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.IsPausedResponse:
        async def paused() -> pb.IsPausedResponse:
            return pb.IsPausedResponse(paused=await control_service.is_paused(self.state))

        return await self._answer(context, "IsPaused", paused)

    async def Sleep(self, request: pb.SleepRequest, context: grpc.aio.ServicerContext) -> pb.SleepResponse:  # noqa: N802
        return await self._answer(context, "Sleep", _no_sleep_mode)

    async def WakeUp(self, request: pb.WakeUpRequest, context: grpc.aio.ServicerContext) -> pb.WakeUpResponse:  # noqa: N802
        return await self._answer(context, "WakeUp", _no_sleep_mode)

    async def IsSleeping(self, request: pb.IsSleepingRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> pb.IsSleepingResponse:
        GrpcCall("IsSleeping").done(grpc.StatusCode.OK)
        return pb.IsSleepingResponse(sleeping=False)

    # ------------------------------------------------------------------ weights (app/server/weight_service.py)

    async def InitWeightTransferEngine(self, request: pb.InitWeightTransferEngineRequest,  # noqa: N802
                                       context: grpc.aio.ServicerContext) -> pb.InitWeightTransferEngineResponse:
        async def init() -> pb.InitWeightTransferEngineResponse:
            info = _json_object(request.init_info_json, "init_info_json")
            await weight_service.init_transfer_engine(self.state, info, "initialize the transfer")
            return pb.InitWeightTransferEngineResponse()

        return await self._answer(context, "InitWeightTransferEngine", init)

    async def StartWeightUpdate(self, request: pb.StartWeightUpdateRequest,  # noqa: N802
                                context: grpc.aio.ServicerContext) -> pb.StartWeightUpdateResponse:
        async def start() -> pb.StartWeightUpdateResponse:
            await weight_service.start_weight_update(self.state)
            return pb.StartWeightUpdateResponse()

        return await self._answer(context, "StartWeightUpdate", start)

    async def StartDraftWeightUpdate(self, request: pb.StartDraftWeightUpdateRequest,  # noqa: N802
                                     context: grpc.aio.ServicerContext) -> pb.StartDraftWeightUpdateResponse:
        async def draft() -> pb.StartDraftWeightUpdateResponse:
            raise ApiError(501, "tito serves no draft (speculative decoding) model: draft weight updates are not "
                                "offered (RlCapabilities.draft_weight_updates_enabled is false).")

        return await self._answer(context, "StartDraftWeightUpdate", draft)

    async def UpdateWeights(self, request: pb.UpdateWeightsRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> pb.UpdateWeightsResponse:
        async def update() -> pb.UpdateWeightsResponse:
            info = _json_object(request.update_info_json, "update_info_json")
            await weight_service.update_weights(self.state, info)
            return pb.UpdateWeightsResponse()

        return await self._answer(context, "UpdateWeights", update)

    async def FinishWeightUpdate(self, request: pb.FinishWeightUpdateRequest,  # noqa: N802
                                 context: grpc.aio.ServicerContext) -> pb.FinishWeightUpdateResponse:
        async def finish() -> pb.FinishWeightUpdateResponse:
            version = request.weight_version if request.HasField("weight_version") else None
            await weight_service.finish_weight_update(self.state, version)
            return pb.FinishWeightUpdateResponse()

        return await self._answer(context, "FinishWeightUpdate", finish)

    async def UpdateWeightVersion(self, request: pb.UpdateWeightVersionRequest,  # noqa: N802
                                  context: grpc.aio.ServicerContext) -> pb.UpdateWeightVersionResponse:
        async def label() -> pb.UpdateWeightVersionResponse:
            version = request.weight_version
            if not version:
                raise bad_request("weight_version must be a non-empty label.", "weight_version")
            await weight_service.set_weight_version(self.state, version)
            return pb.UpdateWeightVersionResponse()

        return await self._answer(context, "UpdateWeightVersion", label)

    async def GetWeightVersion(self, request: pb.GetWeightVersionRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext) -> pb.GetWeightVersionResponse:
        async def version() -> pb.GetWeightVersionResponse:
            v = await weight_service.weight_version(self.state, "get_weight_version")
            return pb.GetWeightVersionResponse(weight_version=v)

        return await self._answer(context, "GetWeightVersion", version)


async def _no_sleep_mode() -> Any:
    raise ApiError(501, "sleep mode is not offered by tito (RlCapabilities.sleep_mode_enabled is false): its engine "
                        "keeps weights and KV cache resident.")
