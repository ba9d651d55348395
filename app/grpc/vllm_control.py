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
Req = TypeVar("Req")

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


def rpc(method: Callable[[ControlServicer, Req], Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A call of the service written as ``method(self, request)``: gRPC's ``(request, context)`` handler runs it
    through ``_answer`` under the method's name (counted, its errors as statuses)."""

    @functools.wraps(method)
    async def handler(self: ControlServicer, request: Req, context: grpc.aio.ServicerContext) -> T:
        return await self._answer(context, method.__name__, method(self, request))

    return handler


class ControlServicer(pb_grpc.ControlServicer):
    def __init__(self, state: AppState) -> None:
        self.state = state

    @functools.cached_property
    def server(self) -> pb.ServerInfo:
        return server_info(self.state)  # once: the sidecar requires the same answer on every connection

    @functools.cached_property
    def model(self) -> pb.ModelInfo:
        return model_info(self.state)

    async def _answer(self, context: grpc.aio.ServicerContext, method: str, work: Awaitable[T]) -> T:
        """Await the call's work, count the call, and end it with the status of an ``ApiError`` (an unexpected failure
        is INTERNAL, or UNAVAILABLE when the engine is dead)."""
        call = GrpcCall(method)
        try:
            out = await work
        except ApiError as e:
            await fail(context, call, e)
        except Refused as e:
            call.done(e.code)
            await context.abort(e.code, str(e))
        except Exception as e:  # noqa: BLE001 - a status with a message, never a stack trace
            await fail(context, call, self.state.engine_error(e, method))
        finally:
            self.state.changed()  # several API processes: what this call changed, before its answer leaves
        call.done(grpc.StatusCode.OK)
        return out

    # ------------------------------------------------------------------ discovery

    @rpc
    async def GetServerInfo(self, request: pb.GetServerInfoRequest) -> pb.ServerInfo:  # noqa: N802
        return self.server

    @rpc
    async def GetModelInfo(self, request: pb.GetModelInfoRequest) -> pb.ModelInfo:  # noqa: N802
        return self.model

    @rpc
    async def GetKvEventSources(self, request: pb.GetKvEventSourcesRequest) -> pb.GetKvEventSourcesResponse:  # noqa: N802
        out = pb.GetKvEventSourcesResponse()
        for src in self.state.engine.kv_event_sources():
            out.sources.add(transport="zmq", endpoint=src["endpoint"], topic=src["topic"],
                            replay_endpoint=src["replay_endpoint"], data_parallel_rank=src["rank"],
                            encoding="msgpack", buffer_steps=src["buffer_steps"], hwm=src["hwm"],
                            max_queue_size=src["max_queue_size"])
        return out

    # ------------------------------------------------------------------ requests and lifecycle

    @rpc
    async def Abort(self, request: pb.AbortRequest) -> pb.AbortResponse:  # noqa: N802
        # By the ids callers gave their requests; an unknown or finished id is not an error (the sidecar aborts
        # every request its client left, finished or not).
        ids = [i for i in request.request_ids if i]
        n = await self.state.abort(ids) if ids else 0
        if n:
            log.info("gRPC Abort %s: %d request(s) hit", ids, n)
        return pb.AbortResponse()

    @rpc
    async def Shutdown(self, request: pb.ShutdownRequest) -> pb.ShutdownResponse:  # noqa: N802
        log.warning("gRPC Shutdown: draining and exiting, as on SIGTERM")
        asyncio.get_running_loop().call_later(SHUTDOWN_DELAY_S, os.kill, os.getpid(), signal.SIGTERM)
        return pb.ShutdownResponse()

    # ------------------------------------------------------------------ LoRA

    @staticmethod
    def _adapter(entry: Any) -> pb.LoraAdapter:
        return pb.LoraAdapter(lora_id=entry.int_id, lora_name=entry.name, source_path=entry.path)

    @rpc
    async def LoadLora(self, request: pb.LoadLoraRequest) -> pb.LoadLoraResponse:  # noqa: N802
        if request.lora_name in self.state.loras:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"LoRA adapter '{request.lora_name}' is already "
                          "loaded; unload it first (tito reloads in place only over HTTP /load_lora_adapter).")
        entry = await self.state.adapters.load(request.lora_name, _source_path(request.source_path), inplace=False)
        return pb.LoadLoraResponse(adapter=self._adapter(entry))

    @rpc
    async def UnloadLora(self, request: pb.UnloadLoraRequest) -> pb.UnloadLoraResponse:  # noqa: N802
        entry = self.state.adapters.resolve(request.lora_name) if request.lora_name else None
        await self.state.adapters.unload(request.lora_name)
        return pb.UnloadLoraResponse(adapter=self._adapter(entry))

    @rpc
    async def ListLoras(self, request: pb.ListLorasRequest) -> pb.ListLorasResponse:  # noqa: N802
        return pb.ListLorasResponse(adapters=[self._adapter(e) for e in self.state.loras.values()])

    # ------------------------------------------------------------------ generation control

    @rpc
    async def PauseGeneration(self, request: pb.PauseGenerationRequest) -> pb.PauseGenerationResponse:  # noqa: N802
        mode = _MODES.get(request.mode)
        if mode is None:
            raise bad_request(f"unknown pause mode {request.mode}.", "mode")
        clear = request.clear_cache if request.HasField("clear_cache") else True
        await control_service.pause_generation(self.state, mode, clear, PAUSE_TIMEOUT_S)
        return pb.PauseGenerationResponse()

    @rpc
    async def ResumeGeneration(self, request: pb.ResumeGenerationRequest) -> pb.ResumeGenerationResponse:  # noqa: N802
        await control_service.resume_generation(self.state, RESUME_TIMEOUT_S)
        return pb.ResumeGenerationResponse()

    @rpc
    async def IsPaused(self, request: pb.IsPausedRequest) -> pb.IsPausedResponse:  # noqa: N802
        return pb.IsPausedResponse(paused=await control_service.is_paused(self.state))

    @rpc
    async def Sleep(self, request: pb.SleepRequest) -> pb.SleepResponse:  # noqa: N802
        raise _no_sleep_mode()

    @rpc
    async def WakeUp(self, request: pb.WakeUpRequest) -> pb.WakeUpResponse:  # noqa: N802
        raise _no_sleep_mode()

    @rpc
    async def IsSleeping(self, request: pb.IsSleepingRequest) -> pb.IsSleepingResponse:  # noqa: N802
        return pb.IsSleepingResponse(sleeping=False)

    # ------------------------------------------------------------------ weights (app/server/weight_service.py)

    @rpc
    async def InitWeightTransferEngine(self, request: pb.InitWeightTransferEngineRequest,  # noqa: N802
                                       ) -> pb.InitWeightTransferEngineResponse:
        info = _json_object(request.init_info_json, "init_info_json")
        await weight_service.init_transfer_engine(self.state, info, "initialize the transfer")
        return pb.InitWeightTransferEngineResponse()

    @rpc
    async def StartWeightUpdate(self, request: pb.StartWeightUpdateRequest) -> pb.StartWeightUpdateResponse:  # noqa: N802
        await weight_service.start_weight_update(self.state)
        return pb.StartWeightUpdateResponse()

    @rpc
    async def StartDraftWeightUpdate(self, request: pb.StartDraftWeightUpdateRequest,  # noqa: N802
                                     ) -> pb.StartDraftWeightUpdateResponse:
        raise ApiError(501, "tito serves no draft (speculative decoding) model: draft weight updates are not "
                            "offered (RlCapabilities.draft_weight_updates_enabled is false).")

    @rpc
    async def UpdateWeights(self, request: pb.UpdateWeightsRequest) -> pb.UpdateWeightsResponse:  # noqa: N802
        info = _json_object(request.update_info_json, "update_info_json")
        await weight_service.update_weights(self.state, info)
        return pb.UpdateWeightsResponse()

    @rpc
    async def FinishWeightUpdate(self, request: pb.FinishWeightUpdateRequest) -> pb.FinishWeightUpdateResponse:  # noqa: N802
        version = request.weight_version if request.HasField("weight_version") else None
        await weight_service.finish_weight_update(self.state, version)
        return pb.FinishWeightUpdateResponse()

    @rpc
    async def UpdateWeightVersion(self, request: pb.UpdateWeightVersionRequest,  # noqa: N802
                                  ) -> pb.UpdateWeightVersionResponse:
        version = request.weight_version
        if not version:
            raise bad_request("weight_version must be a non-empty label.", "weight_version")
        await weight_service.set_weight_version(self.state, version)
        return pb.UpdateWeightVersionResponse()

    @rpc
    async def GetWeightVersion(self, request: pb.GetWeightVersionRequest) -> pb.GetWeightVersionResponse:  # noqa: N802
        return pb.GetWeightVersionResponse(weight_version=await weight_service.weight_version(
            self.state, "get_weight_version"))


def _no_sleep_mode() -> ApiError:
    return ApiError(501, "sleep mode is not offered by tito (RlCapabilities.sleep_mode_enabled is false): its engine "
                         "keeps weights and KV cache resident.")
