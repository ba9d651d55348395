"""vLLM's ``VllmEngine`` gRPC service (``smg-grpc-proto``) on tito's engine and ``AppState``.

tito's own servicer, not ``smg-grpc-servicer``'s: that package registers a vLLM plugin that loads in every vLLM
process and patches vLLM's argument parser, and its Generate bypasses everything tito guarantees over HTTP. Here a
proto request is turned into tito's HTTP ``GenerateRequest`` and goes through the very functions HTTP uses
(app/grpc/token_request.py): ``AppState.admit`` / ``enter`` / ``leave`` / ``abort``, ``check_prompt`` and
``build_sampling_params`` (so a bad request gets ``INVALID_ARGUMENT`` with the HTTP 400's message, before the
engine), and the engine error mapping of ``routers/generate.py``. The wire answers follow vLLM's own servicer
(stream: a chunk per engine output and a ``complete`` per finished choice; unary: one ``complete`` per choice), which
is what the smg gateway reads.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import time
import uuid
import zipfile
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from app.core.protocol import ApiError, GenerateRequest, bad_request
from app.grpc.kv_events import CursorExpired, stream_batches
from app.grpc.status import GrpcCall, abort_later, fail
from app.grpc.token_request import admit, refuse_media, refuse_text_prompt, refuse_truncation, sent, token_request
from app.server.requests import data_parallel_rank
from app.server.server_info import server_info_body
from app.server.state import GENERATE_PREFIX, AppState

if TYPE_CHECKING:
    from app.engine.adapter import CompletionOutput, RequestOutput

log = logging.getLogger("tito.grpc")

# The files smg's tokenizer loader reads (what vLLM's servicer bundles for GetTokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.json")
TOKENIZER_CHUNK = 64 * 1024
SERVER_INFO_KEY = "tito-server-info"  # trailing metadata of GetServerInfo: /server_info's body as JSON


# --------------------------------------------------------------------------------------------------- requests


def _wire_sampling(p: pb.SamplingParams) -> dict[str, Any]:
    """The proto's sampling params as the token API's JSON keys (zeros: not sent, ``sent``)."""
    sp = {name: getattr(p, name) for name in ("temperature", "max_tokens", "logprobs", "prompt_logprobs", "seed")
          if p.HasField(name)}
    sp |= sent((name, getattr(p, name)) for name in (
        "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens", "n",
        "ignore_eos", "include_stop_str_in_output"))
    sp |= sent((("stop", list(p.stop)), ("stop_token_ids", list(p.stop_token_ids)),
                ("logit_bias", dict(p.logit_bias))))
    constraint = p.WhichOneof("constraint")
    if constraint:
        value = getattr(p, constraint)
        sp["structured_outputs"] = {constraint: list(value.choices) if constraint == "choice" else value}
    return sp


def to_generate_request(msg: pb.GenerateRequest) -> GenerateRequest:
    """A proto GenerateRequest as tito's HTTP ``GenerateRequest`` (raises ``ApiError(400)`` as HTTP would)."""
    kind = msg.WhichOneof("input")
    if kind == "text":
        raise refuse_text_prompt("tokenized.input_ids")
    if msg.sampling_params.HasField("truncate_prompt_tokens"):
        raise refuse_truncation("sampling_params.truncate_prompt_tokens")
    body: dict[str, Any] = {
        "token_ids": list(msg.tokenized.input_ids) if kind == "tokenized" else [],
        "sampling_params": _wire_sampling(msg.sampling_params),
        "request_id": msg.request_id or None,
        "stream": msg.stream,
    }
    if msg.HasField("mm_inputs") or msg.extra_mm_inputs or msg.HasField("media_refs"):
        raise refuse_media("mm_inputs")
    if msg.HasField("kv_transfer_params_json"):
        try:
            kv = json.loads(msg.kv_transfer_params_json)
        except ValueError:
            kv = None
        if not isinstance(kv, dict):
            raise bad_request("kv_transfer_params_json must be a JSON object.", "kv_transfer_params_json")
        body["kv_transfer_params"] = kv
    elif msg.HasField("kv_transfer_params"):
        legacy = msg.kv_transfer_params
        body["kv_transfer_params"] = {"remote_host": legacy.remote_host, "remote_port": legacy.remote_port}
    return token_request(body)


# --------------------------------------------------------------------------------------------------- answers


def _top(step: Any, k: int | None) -> pb.TopLogProbs:
    top = pb.TopLogProbs()
    if k and step:
        for j, (tid, lp) in enumerate(step.items()):
            if k != -1 and j >= k:
                break
            top.token_ids.append(tid)
            top.values.append(lp.logprob)
    return top


def output_logprobs(c: CompletionOutput, k: int | None) -> pb.OutputLogProbs | None:
    if not c.logprobs:
        return None
    out = pb.OutputLogProbs()
    for tid, step in zip(c.token_ids, c.logprobs, strict=False):
        lp = step.get(tid) if step is not None else None
        if lp is None:
            continue
        out.token_logprobs.append(lp.logprob)
        out.token_ids.append(tid)
        if k:
            out.top_logprobs.append(_top(step, k))
    return out if out.token_ids else None


def input_logprobs(res: RequestOutput, k: int | None) -> pb.InputLogProbs | None:
    if not res.prompt_logprobs or not res.prompt_token_ids:
        return None
    out = pb.InputLogProbs()
    for tid, step in zip(res.prompt_token_ids, res.prompt_logprobs, strict=False):
        entry = pb.InputTokenLogProb()
        if step is not None and tid in step:
            entry.value = step[tid].logprob
        out.token_logprobs.append(entry)
        out.token_ids.append(tid)
        if k:
            out.top_logprobs.append(_top(step, k))
    return out


def _chunk(res: RequestOutput, c: CompletionOutput, k: int | None, pk: int | None, first: bool) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
        token_ids=c.token_ids, prompt_tokens=len(res.prompt_token_ids or ()), completion_tokens=len(c.token_ids),
        cached_tokens=res.num_cached_tokens or 0, output_logprobs=output_logprobs(c, k),
        input_logprobs=input_logprobs(res, pk) if first else None, index=c.index))


def _complete(res: RequestOutput, c: CompletionOutput, k: int | None, pk: int | None) -> pb.GenerateResponse:
    done = pb.GenerateComplete(
        output_ids=c.token_ids, finish_reason=c.finish_reason or "stop",
        prompt_tokens=len(res.prompt_token_ids or ()), completion_tokens=len(c.token_ids),
        cached_tokens=res.num_cached_tokens or 0, output_logprobs=output_logprobs(c, k),
        input_logprobs=input_logprobs(res, pk), index=c.index)
    if isinstance(c.stop_reason, int):
        done.matched_token_id = c.stop_reason
    if res.kv_transfer_params is not None:
        done.kv_transfer_params_json = json.dumps(res.kv_transfer_params)
    return pb.GenerateResponse(complete=done)


# --------------------------------------------------------------------------------------------------- servicer


class TitoEngineServicer(pb_grpc.VllmEngineServicer):
    """``VllmEngine`` on tito's ``AppState``. Embed, FlushCache and the profiler RPCs stay UNIMPLEMENTED."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        self._tokenizer_zip: tuple[bytes, str] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        call = GrpcCall("Generate")
        state = self.state
        try:
            req = to_generate_request(request)
            params = admit(state, req)
            rank = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
            dp_rank = data_parallel_rank(rank, state.facts.data_parallel_size, "data_parallel_rank")
        except ApiError as e:
            await fail(context, call, e)
            return
        request_id = GENERATE_PREFIX + (req.request_id or uuid.uuid4().hex)
        k, pk = params.logprobs, params.prompt_logprobs
        err: ApiError | None = None
        finished = False
        # The engine sees a unique id (clients may share theirs), as on the HTTP path.
        engine_id = state.enter(request_id)
        try:
            gen = state.engine.generate(req.token_ids, params, engine_id, cache_salt=None, lora=None,
                                        data_parallel_rank=dp_rank)
            seen: set[int] = set()
            async for res in gen:
                for c in sorted(res.outputs, key=lambda o: o.index):
                    if req.stream:
                        await context.write(_chunk(res, c, k, pk, c.index not in seen))
                        seen.add(c.index)
                        if c.finish_reason is not None:
                            await context.write(_complete(res, c, k, pk))
                    elif res.finished:
                        await context.write(_complete(res, c, k, pk))
                        seen.add(c.index)
            finished = True
            if not seen:
                err = ApiError(500, "engine returned no output")  # as HTTP answers the same case
        except ApiError as e:
            err, finished = e, True
        except asyncio.CancelledError:
            raise  # the client went away: AsyncLLM aborts a request whose generator is cancelled
        except Exception as e:  # noqa: BLE001 - mapped to a status, never a hang
            err, finished = state.engine_error(e, "generation", param_prefix="sampling_params."), True
        finally:
            state.leave(engine_id)
            if not finished:
                abort_later(state.engine.abort, engine_id, self._tasks)
        if err is not None:
            await fail(context, call, err)
        call.done(grpc.StatusCode.OK)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:  # noqa: N802
        # Only the named requests (by the client's id or the engine's): never "everything" from the data plane.
        ids = [i for i in request.request_ids if i]
        n = await self.state.abort(ids) if ids else 0
        log.info("gRPC Abort %s: %d request(s) hit", ids, n)
        GrpcCall("Abort").done(grpc.StatusCode.OK)
        return pb.AbortResponse()

    async def HealthCheck(self, request: pb.HealthCheckRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        reason = self.state.not_ready_reason
        if reason == "engine_dead":
            return pb.HealthCheckResponse(healthy=False, message=f"engine is dead: {self.state.engine_death_cause()}")
        return pb.HealthCheckResponse(healthy=reason is None, message=reason or "ok")

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        f = self.state.facts
        model_dir = Path(f.path)
        return pb.GetModelInfoResponse(
            model_path=f.path, is_generation=True, max_context_length=f.max_model_len, vocab_size=f.vocab_size,
            supports_vision=False, served_model_name=f.name,
            tokenizer_path=f.path if _tokenizer_files(model_dir) else "",
            model_type=f.model_type, architectures=list(f.architectures), eos_token_ids=list(f.eos_token_ids),
            pad_token_id=f.pad_token_id or 0, bos_token_id=f.bos_token_id or 0,
            # The longest prompt tito takes: one token of room is left to generate (check_prompt).
            max_req_input_len=f.max_model_len - 1, default_sampling_params_json="{}")

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        state = self.state
        info = await server_info_body(state, None)
        info.pop("routes", None)
        # The full /server_info body rides along as JSON (the proto has no field for draining, DP span, ...).
        context.set_trailing_metadata(((SERVER_INFO_KEY, json.dumps(info)),))
        f = state.facts
        return pb.GetServerInfoResponse(
            active_requests=state.inflight, is_paused=bool(info["state"]["paused"]),
            uptime_seconds=time.time() - state.started_at, server_type="tito-grpc",
            data_parallel_size=state.facts.data_parallel_size, kv_cache_dtype=f.kv_cache_dtype,
            block_size=f.kv_block_size, model_dtype=f.dtype,
            max_num_seqs=state.facts.max_num_seqs)

    async def GetLoads(self, request: pb.GetLoadsRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.GetLoadsResponse:
        from app.engine.adapter import vllm_version

        state = self.state
        capacity = state.facts.num_kv_blocks * state.facts.kv_block_size
        running, waiting, usage = state.engine.scheduler_load() or (state.inflight, 0, 0.0)
        load = pb.SchedulerLoad(dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting,
                                num_total_reqs=state.inflight, max_total_num_tokens=capacity, token_usage=usage,
                                max_running_requests=state.facts.max_num_seqs)
        return pb.GetLoadsResponse(timestamp=datetime.now(UTC).isoformat(), version=vllm_version(),
                                   dp_rank_count=1, loads=[load])

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        model_dir = Path(self.state.facts.path)
        if not _tokenizer_files(model_dir):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the model directory {model_dir} has no tokenizer files (tito serves tokens only); "
                                "give the gateway a tokenizer with its own --model-path / --tokenizer-path.")
        if self._tokenizer_zip is None:
            self._tokenizer_zip = await asyncio.to_thread(_zip_tokenizer, model_dir)
        data, digest = self._tokenizer_zip
        for i in range(0, len(data), TOKENIZER_CHUNK):
            last = i + TOKENIZER_CHUNK >= len(data)
            yield common_pb2.GetTokenizerChunk(data=data[i:i + TOKENIZER_CHUNK], sha256=digest if last else "")

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,  # noqa: N802
                                context: grpc.aio.ServicerContext) -> None:
        """The engine's KV-cache events (app/grpc/kv_events.py), from ``start_sequence_number`` on. DP rank 0's
        publisher only: each rank numbers its batches on its own, and one stream has one sequence (as smg's own
        vLLM servicer does). No ``load`` records ride along: smg keeps polling GetLoads for this worker."""
        call = GrpcCall("SubscribeKvEvents")
        state = self.state
        endpoints = state.engine.kv_event_endpoints()
        if not endpoints:
            # UNIMPLEMENTED, at once: the gateway then stops subscribing to this worker instead of retrying.
            call.done(grpc.StatusCode.UNIMPLEMENTED)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "KV cache events are off on this tito server: start it with --kv-events-port "
                                "(0 picks a free port) to stream them.")
        rank = min(endpoints)
        replay = state.engine.kv_event_replay_endpoints().get(rank)
        # Headers at once: the gateway bounds how long the subscription may take to answer.
        await context.send_initial_metadata(())

        def wanted() -> bool:  # the stream ends (OK) when the server shuts down or its engine died
            return not context.cancelled() and not state.shutting_down and not state.engine.errored

        code, message = grpc.StatusCode.OK, ""
        try:
            async for batch in stream_batches(endpoints[rank], replay, request.start_sequence_number, wanted):
                await context.write(batch)
        except CursorExpired as e:
            code, message = grpc.StatusCode.OUT_OF_RANGE, f"{e}; subscribe with start_sequence_number 0."
        except TimeoutError as e:
            code, message = grpc.StatusCode.UNAVAILABLE, str(e)
        except asyncio.CancelledError:
            call.done(grpc.StatusCode.CANCELLED)
            raise
        except Exception as e:  # noqa: BLE001 - a broken publisher socket ends the stream with a status, not a hang
            log.exception("SubscribeKvEvents failed")
            code, message = grpc.StatusCode.INTERNAL, f"KV event relay failed: {e}"
        call.done(code)
        if code is not grpc.StatusCode.OK:
            await context.abort(code, message)


def _tokenizer_files(model_dir: Path) -> list[Path]:
    return [model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file() and n != "config.json"]


def _zip_tokenizer(model_dir: Path) -> tuple[bytes, str]:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                zf.write(model_dir / name, name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()
