"""What this server is, for every transport: ``/server_info``'s body (HTTP) and gRPC ``GetServerInfo``'s JSON
trailer. Model, limits, parallelism, features and state; the transport adds its own route map."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from datetime import UTC, datetime
from typing import Any

from app import __version__
from app.engine.adapter import vllm_version
from app.engine.engine_setup import has_tokenizer
from app.server.state import AppState

log = logging.getLogger("tito.info")

# Bump only on an incompatible change (a key removed, renamed or retyped); adding keys keeps the version.
SERVER_INFO_SCHEMA_VERSION = 1


async def _paused(state: AppState) -> bool | None:
    if state.engine.errored:
        return None
    try:
        # The engine's own answer, not tito's record of it: /server_info is where the two can be compared.
        return await asyncio.wait_for(state.engine.is_paused(ask_engine=True), 5.0)
    except Exception as e:  # noqa: BLE001 - unknown is an honest answer; the info route must still answer
        log.warning("is_paused failed: %s", e)
        return None


async def server_info_body(state: AppState, routes: dict[str, Any] | None) -> dict[str, Any]:
    """``/server_info``'s body, with the transport's ``routes`` (HTTP's route map; None over gRPC)."""
    f, s = state.facts, state.settings
    now = time.time()
    dead = state.engine.errored
    error = state.engine_death_cause() if dead else None
    return {
        "schema_version": SERVER_INFO_SCHEMA_VERSION,
        "server": {
            "name": "tito",
            "version": __version__,
            "vllm_version": vllm_version(),
            "pid": os.getpid(),
            "host": s.host,
            "port": s.port,
            "grpc_port": s.grpc_port,
            "grpc_server": s.grpc_server if s.grpc_port is not None else None,
            "started_at": datetime.fromtimestamp(state.started_at, UTC).isoformat(),
            "started_at_unix": state.started_at,
            "uptime_s": round(now - state.started_at, 3),
        },
        "model": {
            "served_model_name": f.name,
            "path": f.path,
            "dtype": f.dtype,
            "max_model_len": f.max_model_len,
            "vocab_size": f.vocab_size,
            "max_num_seqs": f.max_num_seqs,
            "max_logprobs": f.max_logprobs,
            # What `logprobs` hold: vLLM's --logprobs-mode (processed_logprobs: after temperature, top-k/top-p).
            "logprobs_mode": f.logprobs_mode,
            "head_dtype": f.head_dtype,
            "kv_block_size": f.kv_block_size,
            "num_kv_blocks": f.num_kv_blocks,
            # Tokenizer files beside the weights (a text frontend may use them) / the engine loaded them (the text
            # routes work: /v1/chat/completions, /tokenize, text prompts).
            "has_tokenizer": has_tokenizer(f.path),
            "tokenizer_loaded": f.tokenizer,
        },
        "parallelism": {
            "tensor_parallel_size": f.tensor_parallel_size,
            "pipeline_parallel_size": f.pipeline_parallel_size,
            "data_parallel_size": f.data_parallel_size,
            # Workers a trainer's weight broadcast reaches (tp x pp x dp), as /get_world_size reports it.
            "world_size": state.engine.world_size(True),
            # Ranks this server answers for (X-data-parallel-rank): [start, start + size).
            "data_parallel_rank_start": 0,
            "data_parallel_rank_end": f.data_parallel_size,
            # Processes serving the port (--api-server-count), each an engine client, with one control plane.
            "api_server_count": len(state.peers.info()) - 1 if state.peers is not None else 1,
        },
        "features": {
            "lora": f.enable_lora,
            "max_loras": f.max_loras,
            "max_lora_rank": f.max_lora_rank,
            # Served with LoRA too: exact per prompt row under each request's adapter (app/engine/vllm_patches.py).
            "prompt_logprobs": True,
            "min_tokens": not state.limits.min_tokens_refusal,  # refused when an eos id lies outside the vocabulary
            # --enable-return-routed-experts (refused at start where they cannot be captured: routed_experts.py).
            "routed_experts": s.enable_return_routed_experts,
            "prefix_caching": s.enable_prefix_caching,
            "priority_scheduling": f.priority_scheduling,
            # DP rank -> ZMQ address of its KV-cache event publisher (--kv-events-port); empty when off.
            "kv_events": {str(r): ep for r, ep in state.engine.kv_event_endpoints().items()},
            "tool_call_parser": s.vllm_args.get("tool_call_parser"),
            "auto_tool_choice": bool(s.vllm_args.get("enable_auto_tool_choice")),
            "reasoning_parser": f.reasoning_parser or None,
        },
        # The vLLM arguments given on the command line beyond tito's own settings (`tito serve --help`), as JSON.
        "vllm_args": json.loads(json.dumps(s.vllm_args, default=str)),
        "state": {
            "engine": "dead" if dead else "alive",
            "engine_error": error,
            "ready": state.not_ready_reason is None,
            "not_ready_reason": state.not_ready_reason,
            "draining": state.draining,
            "shutting_down": state.shutting_down,
            "paused": await _paused(state),
            "control": state.control.info(),  # pause/resume/update queue (app/server/control.py)
            "inflight": state.inflight,
            "weight_version": state.weight_version,
            "weights_inconsistent": state.weights.inconsistent is not None,
            "weights_inconsistent_detail": state.weights.inconsistent.body() if state.weights.inconsistent else None,
            "weight_update_running": state.weights.busy,
            # Staged versions, Prime-RL's active version and the workers' delta copy (app/weights/staging.py).
            "staging": state.staging.info(),
            # What a restart restores (app/weights/record.py): the record, and how the last start restored it.
            "weight_record": state.weights.recorder.info() if state.weights.recorder is not None else None,
            "loaded_adapters": [{"name": e.name, "path": e.path, "int_id": e.int_id, "loaded_at": e.loaded_at}
                                for e in state.loras.values()],
        },
        # With several API processes: each of them, then the control process (which answers this), with their
        # counts: requests in flight, finished, admitted; control calls forwarded; the board they last applied.
        "api_processes": state.peers.info() if state.peers is not None else None,
        # The child Dynamo sidecar (--dynamo-namespace): running | restarting | stopping | stopped | failed | waiting.
        "dynamo": state.sidecar.info() if state.sidecar is not None else None,
        "routes": routes,
    }
