"""vLLM's native ``vllm.Inference`` service (``app/grpc/proto/vllm_inference.proto``) on tito's engine and ``AppState``:
what Dynamo's vLLM sidecar (``python -m dynamo.vllm.sidecar``) drives.

A request is turned into tito's HTTP ``GenerateRequest`` and goes through the HTTP path's own checks and accounting
(app/grpc/token_request.py: ``AppState.admit`` / ``enter`` / ``leave``, ``check_prompt``, ``build_sampling_params``,
``resolve_model``): bad
input is ``INVALID_ARGUMENT`` with the HTTP 400's words, before the engine. The stream has the shape the sidecar
reads: the first message carries ``prompt_info``; each message one sequence's new tokens (``num_tokens`` of them),
their detokenized text (``app/grpc/detokenize.py``), logprobs, ranks and candidates when asked; the sequence's last
message its ``finish_info`` (LENGTH, STOP or ABORTED, the stop token or string, ``kv_transfer_params``).
``Generate`` (unary) returns the same as one message. ``x-data-parallel-rank`` metadata picks the engine core.

Coalescing under backpressure: the stream takes the engine's next output only once its last write has completed.
While a write is held up (a reader behind, its HTTP/2 window full), vLLM's per-request output collector merges the
engine's new delta outputs, so the next message carries every token made meanwhile (``num_tokens`` > 1, as the
sidecar and smg read them); a reader that keeps up gets each step's tokens at once, no latency added.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import json_format

from app.core.protocol import ApiError, GenerateRequest, bad_request
from app.engine.sampling import TOKEN_API, refuse_needs_tokenizer
from app.grpc.detokenize import Detokenizer, TextStream
from app.grpc.proto import vllm_inference_pb2 as pb
from app.grpc.proto import vllm_inference_pb2_grpc as pb_grpc
from app.grpc.status import GrpcCall, abort_later, fail
from app.grpc.token_request import admit, refuse_media, refuse_text_prompt, refuse_truncation, sent, token_request
from app.server.requests import data_parallel_rank
from app.server.state import GENERATE_PREFIX, AppState

if TYPE_CHECKING:
    from app.engine.adapter import CompletionOutput, RequestOutput

log = logging.getLogger("tito.grpc")

DP_RANK_KEY = "x-data-parallel-rank"
MAX_STOP_STRINGS = 64
MAX_STOP_LEN = 1024
_FLOOR = -9999.0  # what vLLM sends for -inf / NaN logprobs
FINISH = pb.FinishInfo.FinishReason
_REASONS = {"length": FINISH.LENGTH, "stop": FINISH.STOP, "abort": FINISH.ABORTED, "repetition": FINISH.STOP}


# --------------------------------------------------------------------------------------------------- requests


@dataclass
class Wanted:
    """What the caller asked to get back."""

    text: bool = True
    token_ids: bool = False
    logprobs: bool = False
    prompt_ids: bool = False
    prompt_logprobs: bool = False
    skip_special: bool = True
    stops: list[str] = field(default_factory=list)
    include_stop: bool = False
    min_tokens: int = 0


def _candidates(sel: pb.CandidateTokens, name: str) -> int:
    """A ``CandidateTokens`` selection as a vLLM logprobs count (``all``: -1)."""
    kind = sel.WhichOneof("select")
    if kind == "top_n":
        return int(sel.top_n)
    if kind == "all":
        return -1
    if kind == "token_ids":
        raise bad_request("candidates by token_ids are not supported; ask for top_n.", f"response.{name}")
    return 0


def _struct(msg: Any, has: bool) -> dict[str, Any] | None:
    return json_format.MessageToDict(msg) if has else None


def to_generate_request(msg: pb.GenerateRequest, unary: bool = False) -> tuple[GenerateRequest, Wanted]:
    """A ``vllm.GenerateRequest`` as tito's HTTP request (``ApiError(400)`` as HTTP words it), and what to send back.
    Numbers that read 0 mean "not set" on this wire, so they are left out and tito's defaults apply. ``unary``: for
    ``Generate``, which asks the engine for the final output only (as HTTP's JSON answer does) unless stop strings
    must be matched token by token to end the sequence early."""
    kind = msg.WhichOneof("prompt")
    if kind == "text":
        raise refuse_text_prompt("token_ids")
    if msg.truncate_prompt_tokens:
        raise refuse_truncation("truncate_prompt_tokens")
    if msg.media:
        raise refuse_media("media")
    s, d, st, r, kv = msg.sampling, msg.decoding, msg.stopping, msg.response, msg.kv
    if d.WhichOneof("structured_output"):
        raise refuse_needs_tokenizer("structured_outputs", TOKEN_API, "decoding.structured_output")
    sp: dict[str, Any] = {}
    if msg.HasField("temperature"):
        sp["temperature"] = msg.temperature
    if s.HasField("seed"):
        sp["seed"] = s.seed
    sp |= sent((("n", s.num_sequences), ("top_k", s.top_k), ("top_p", s.top_p), ("min_p", s.min_p),
                ("presence_penalty", d.presence_penalty), ("frequency_penalty", d.frequency_penalty),
                ("repetition_penalty", d.repetition_penalty), ("max_tokens", st.max_new_tokens),
                ("min_tokens", st.min_new_tokens), ("logit_bias", dict(d.logit_bias)),
                ("allowed_token_ids", list(d.allowed_token_ids)), ("stop_token_ids", list(st.stop_token_ids)),
                ("ignore_eos", st.ignore_eos)))
    if r.output_logprobs or r.HasField("output_candidates"):
        sp["logprobs"] = _candidates(r.output_candidates, "output_candidates")
    if r.prompt_logprobs or r.HasField("prompt_candidates"):
        sp["prompt_logprobs"] = _candidates(r.prompt_candidates, "prompt_candidates")
    if kv.bypass_prefix_cache:
        sp["skip_reading_prefix_cache"] = True
    stops = list(st.stop_strings)
    if len(stops) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_LEN for x in stops):
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop_strings of at most {MAX_STOP_LEN} characters each.",
                          "stopping.stop_strings")
    if stops and s.num_sequences > 1:
        raise bad_request("stop_strings need num_sequences 1.", "stopping.stop_strings")
    body: dict[str, Any] = {
        "token_ids": list(msg.token_ids.ids) if kind == "token_ids" else [],
        "sampling_params": sp,
        "request_id": msg.request_id or None,
        "model": msg.model or None,
        "stream": not unary or any(stops),
        "priority": msg.priority,
        "cache_salt": kv.cache_salt or None,
        "kv_transfer_params": _struct(kv.kv_transfer_params, kv.HasField("kv_transfer_params")),
        "ec_transfer_params": _struct(kv.ec_transfer_params, kv.HasField("ec_transfer_params")),
    }
    req = token_request(body)
    wanted = Wanted(text=r.output_text if r.HasField("output_text") else True, token_ids=r.output_token_ids,
                    logprobs="logprobs" in sp, prompt_ids=r.prompt_token_ids or "prompt_logprobs" in sp,
                    prompt_logprobs="prompt_logprobs" in sp,
                    skip_special=r.skip_special_tokens if r.HasField("skip_special_tokens") else True,
                    stops=[x for x in stops if x], include_stop=st.include_stop_strings,
                    min_tokens=st.min_new_tokens)
    return req, wanted


def rank_metadata(context: grpc.aio.ServicerContext, dp_size: int) -> int | None:
    """The data-parallel rank the call's metadata pins it to (as Dynamo's sidecar sends it)."""
    raw = next((str(v) for k, v in context.invocation_metadata() or () if k == DP_RANK_KEY), None)
    return data_parallel_rank(raw, dp_size, DP_RANK_KEY)


# --------------------------------------------------------------------------------------------------- answers


def _lp(x: float) -> float:
    return _FLOOR if math.isnan(x) or x < _FLOOR else x


def _position(step: Any, tid: int) -> tuple[float, int, pb.CandidateTokenInfo]:
    """One position's logprob and rank of ``tid``, and the other tokens vLLM reported there (best first)."""
    info = pb.CandidateTokenInfo()
    if not step:
        return 0.0, 0, info
    own = step.get(tid)
    for t, v in step.items():
        if t != tid:
            info.tokens.add(id=t, logprob=_lp(v.logprob), rank=v.rank or 0)
    if own is None:
        return _FLOOR, 0, info
    return _lp(own.logprob), own.rank or 0, info


def prompt_info(res: RequestOutput, n_prompt: int, want: Wanted) -> pb.PromptInfo:
    ids = list(res.prompt_token_ids or ())
    out = pb.PromptInfo(num_prompt_tokens=len(ids) or n_prompt)
    if want.prompt_ids:
        out.token_ids.extend(ids)
    if want.prompt_logprobs:
        steps = res.prompt_logprobs or []
        for i, tid in enumerate(ids):
            lp, rank, cands = _position(steps[i] if i < len(steps) else None, tid)
            out.logprobs.append(lp)
            out.ranks.append(rank)
            out.candidate_tokens.append(cands)
    return out


@dataclass
class Sequence:
    """One sampled sequence's progress in a stream."""

    text: TextStream | None
    tokens: int = 0
    done: bool = False


class Answer:
    """Turns the engine's delta outputs of one request into ``GenerateResponse`` messages."""

    def __init__(self, req: GenerateRequest, want: Wanted, detok: Detokenizer | None, eos: tuple[int, ...]) -> None:
        self.req, self.want, self.eos = req, want, eos
        self.stop_ids = set(req.sampling_params.stop_token_ids or ())
        n = req.sampling_params.n or 1
        self.seqs = [Sequence(detok.stream(req.token_ids, skip_special_tokens=want.skip_special, stops=want.stops,
                                           include_stop=want.include_stop, min_tokens=want.min_tokens)
                              if detok is not None and (want.text or want.stops) else None) for _ in range(n)]
        self.first = True
        self.stopped_by_string = False

    def messages(self, res: RequestOutput) -> list[pb.GenerateResponse]:
        out = []
        outputs = res.outputs
        for c in outputs if len(outputs) == 1 else sorted(outputs, key=lambda o: o.index):
            msg = self._sequence(res, c)
            if msg is not None:
                out.append(msg)
        if self.first:
            info = prompt_info(res, len(self.req.token_ids), self.want)
            if not out:
                out.append(pb.GenerateResponse())
            out[0].prompt_info.CopyFrom(info)
            self.first = False
        return out

    def _sequence(self, res: RequestOutput, c: CompletionOutput) -> pb.GenerateResponse | None:
        seq = self.seqs[c.index]
        if seq.done:
            return None
        ids = list(c.token_ids)
        stop_string = None
        if seq.text is not None:
            kept = seq.text.add(ids)
            stop_string = seq.text.stopped
            ids = ids[:kept]
        finished = stop_string is not None or c.finish_reason is not None
        # Filled in place: a SequenceOutput built apart would be copied into the response.
        msg = pb.GenerateResponse()
        o = msg.outputs
        o.index = c.index
        o.num_tokens = len(ids)
        if self.want.token_ids:
            o.token_ids.extend(ids)
        if self.want.logprobs:
            steps = list(c.logprobs or ())
            for i, tid in enumerate(ids):
                lp, rank, cands = _position(steps[i] if i < len(steps) else None, tid)
                o.logprobs.append(lp)
                o.ranks.append(rank)
                o.candidate_tokens.append(cands)
        if seq.text is not None and self.want.text:
            o.text = seq.text.take(finished)
        seq.tokens += len(ids)
        if finished:
            seq.done = True
            self._finish(o, res, c, seq, stop_string)
        elif not ids and not o.text:
            return None
        return msg

    def _finish(self, o: pb.SequenceOutput, res: RequestOutput, c: CompletionOutput, seq: Sequence,
                stop_string: str | None) -> None:
        info = o.finish_info
        info.num_output_tokens = seq.tokens
        if stop_string is not None:
            self.stopped_by_string = True
            info.finish_reason = FINISH.STOP
            info.stop_string = stop_string
        else:
            reason = _REASONS.get(str(c.finish_reason))
            if reason is None:
                raise ApiError(500, f"the engine ended the request with finish reason {c.finish_reason!r}")
            info.finish_reason = reason
            if reason == FINISH.STOP:
                self._stop_reason(info, c)
        kv = res.kv_transfer_params if res.kv_transfer_params is not None else self.req.kv_transfer_params
        if kv is not None:
            json_format.ParseDict(kv, info.kv_transfer_params)

    def _stop_reason(self, info: pb.FinishInfo, c: CompletionOutput) -> None:
        tid = c.stop_reason
        if not isinstance(tid, int):
            last = c.token_ids[-1] if c.token_ids else None
            if last is not None and last in self.eos:
                info.eos_token_id = last
            return
        # Without a tokenizer the engine stops at EOS through its generation config's stop ids; say which it was.
        if tid in self.eos and tid not in self.stop_ids:
            info.eos_token_id = tid
        else:
            info.stop_token_id = tid


def merge(messages: list[pb.GenerateResponse]) -> pb.GenerateResponse:
    """A stream's messages of one sequence as the one message of the unary ``Generate``."""
    out = pb.GenerateResponse()
    for m in messages:
        if m.HasField("prompt_info"):
            out.prompt_info.CopyFrom(m.prompt_info)
        if not m.HasField("outputs"):
            continue
        o, n = out.outputs, m.outputs
        o.index = n.index
        o.text += n.text
        o.num_tokens += n.num_tokens
        o.token_ids.extend(n.token_ids)
        o.logprobs.extend(n.logprobs)
        o.ranks.extend(n.ranks)
        o.candidate_tokens.extend(n.candidate_tokens)
        if n.HasField("finish_info"):
            o.finish_info.CopyFrom(n.finish_info)
    return out


# --------------------------------------------------------------------------------------------------- servicer


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, state: AppState) -> None:
        self.state = state
        self._tasks: set[asyncio.Task[Any]] = set()

    @functools.cached_property
    def detok(self) -> Detokenizer | None:
        detok = Detokenizer.load(self.state.facts.path)
        if detok is None:
            log.warning("%s has no tokenizer.json: vllm.Inference answers carry token ids without text, and "
                        "Dynamo's frontend cannot serve this model through its sidecar", self.state.facts.path)
        return detok

    async def GenerateStream(self, request: pb.GenerateRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> None:
        # Written with context.write (not yielded): a caller that leaves cancels this task inside our own awaits,
        # so the finally below always runs at once and aborts the engine request.
        await self._run(request, context, GrpcCall("GenerateStream"), context.write, unary=False)

    async def Generate(self, request: pb.GenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        messages: list[pb.GenerateResponse] = []

        async def keep(msg: pb.GenerateResponse) -> None:
            messages.append(msg)

        await self._run(request, context, GrpcCall("Generate"), keep, unary=True)
        return messages[0] if len(messages) == 1 else merge(messages)  # one is the answer as it is, not copied

    def _prepare(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                 unary: bool) -> tuple[GenerateRequest, Wanted, Any, Any, int | None]:
        state = self.state
        req, want = to_generate_request(request, unary)
        params = admit(state, req)
        if unary and params.n > 1:
            raise bad_request("Generate returns one sequence; use GenerateStream for num_sequences > 1.",
                              "sampling.num_sequences")
        if want.stops and self.detok is None:
            raise bad_request("stop_strings need the model directory's tokenizer.json, which this model lacks.",
                              "stopping.stop_strings")
        lora = state.adapters.resolve(request.lora_name).handle if request.lora_name else \
            state.resolve_model(req.model)
        return req, want, lora, params, rank_metadata(context, state.facts.data_parallel_size)

    async def _run(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, call: GrpcCall,
                   send: Callable[[pb.GenerateResponse], Awaitable[None]], unary: bool) -> None:
        state = self.state
        try:
            req, want, lora, params, dp_rank = self._prepare(request, context, unary)
        except ApiError as e:
            await fail(context, call, e)
        request_id = GENERATE_PREFIX + (req.request_id or uuid.uuid4().hex)
        salt = req.cache_salt or req.sampling_params.cache_salt
        answer = Answer(req, want, self.detok, state.facts.eos_token_ids)
        err: ApiError | None = None
        finished = False
        engine_id = state.enter(request_id)  # unique in the engine, as on the HTTP path
        try:
            gen = state.engine.generate(req.token_ids, params, engine_id, cache_salt=salt, lora=lora,
                                        priority=req.priority, data_parallel_rank=dp_rank)
            async for res in gen:  # the outputs made while the last write was held up, merged (see above)
                for msg in answer.messages(res):
                    await send(msg)
                if answer.stopped_by_string:
                    break  # the sequence ended at a stop string: the finally aborts the rest in the engine
            finished = True
            if answer.first:
                err = ApiError(500, "engine returned no output")
        except ApiError as e:
            err, finished = e, True
        except asyncio.CancelledError:
            # The caller went away (Dynamo's sidecar resets the stream when its client leaves): the finally aborts
            # the engine request at once.
            call.done(grpc.StatusCode.CANCELLED)
            log.info("gRPC %s %s: the caller left; aborting it in the engine", call.method, request_id)
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a status, never a hang
            err, finished = state.engine_error(e, "generation", param_prefix="sampling_params."), True
        finally:
            state.leave(engine_id)
            if not finished or answer.stopped_by_string:
                abort_later(state.engine.abort, engine_id, self._tasks)
        if err is not None:
            await fail(context, call, err)
        call.done(grpc.StatusCode.OK)
