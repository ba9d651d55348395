"""Every server flag and ``TITO_*`` environment variable, in one place.

Each setting is declared once in ``FLAGS``; the CLI, the environment reader and README's flag table are all
derived from that list. Precedence: command-line flag > ``TITO_<NAME>`` environment variable > default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL_DIR = "models/tiny-qwen3"


@dataclass(frozen=True)
class Flag:
    name: str  # python attribute; CLI is --name-with-dashes, env is TITO_NAME_UPPER
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    repeatable: bool = False  # list-valued: repeat the flag, or comma-separate in the env variable

    @property
    def cli(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "TITO_" + self.name.upper()


def _bool(v: str) -> bool:
    s = v.strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {v!r}")


FLAGS: list[Flag] = [
    # --- where and what to serve
    Flag("model", str, DEFAULT_MODEL_DIR, "Model directory (HF layout: config.json + safetensors)."),
    Flag("host", str, "127.0.0.1", "Address to bind."),
    Flag("port", int, 8000, "Port to bind."),
    Flag("served_model_name", str, None, "Name clients use in `model` (default: the --model value)."),
    # --- engine
    Flag("dtype", str, "auto", "Weight/activation dtype (auto, float32, bfloat16, float16)."),
    Flag("max_model_len", int, None, "Context length (default: the model's)."),
    Flag("max_num_seqs", int, None, "Max concurrent sequences in a batch (default: vLLM's)."),
    Flag("max_logprobs", int, 20, "Largest `logprobs`/`prompt_logprobs` a request may ask for."),
    Flag("seed", int, 0, "Engine random seed."),
    Flag("data_parallel_size", int, 1, "Number of engine cores (vLLM data parallel) behind this server."),
    Flag("tensor_parallel_size", int, 1, "Tensor parallel size per engine core."),
    Flag("enable_prefix_caching", _bool, True, "Reuse KV of shared prompt prefixes."),
    Flag("scheduling_policy", str, "fcfs", "fcfs, or priority to honour the request `priority`.",
         choices=("fcfs", "priority")),
    Flag("enforce_eager", _bool, None, "Disable graph capture (default: on for CPU, off for GPU)."),
    Flag("gpu_memory_utilization", float, None,
         "Fraction of device memory for vLLM (CPU: of the NUMA node's RAM; default 0.3 on CPU, 0.9 on GPU)."),
    Flag("num_kv_blocks", int, None,
         "Fix the number of KV cache blocks (vLLM's num_gpu_blocks_override): caps KV memory exactly; small values "
         "make the scheduler preempt under load."),
    Flag("kv_cache_space_gib", float, 1.0, "CPU only: GiB of KV cache (sets VLLM_CPU_KVCACHE_SPACE if unset)."),
    Flag("enable_lora", _bool, False, "Serve LoRA adapters."),
    Flag("max_lora_rank", int, 16, "Largest LoRA rank an adapter may have."),
    Flag("max_loras", int, 4, "LoRA adapters in one batch."),
    Flag("max_cpu_loras", int, None, "LoRA adapters kept in host memory (default: max_loras)."),
    Flag("warmup", _bool, True, "Run one real generation before reporting ready."),
    Flag("weight_transfer_backend", str, None,
         "vLLM weight-transfer backend for /init_weight_transfer_engine (nccl, ipc, ...; all need a GPU)."),
    # --- security
    Flag("allowed_weight_root", str, None,
         "Directory that weight_dir/lora_path may resolve into (repeatable; default: the model's parent and the "
         "working directory).", repeatable=True),
    Flag("allow_any_weight_path", _bool, False, "Let requests load weights from any path (unsafe)."),
    Flag("api_key", str, None, "Bearer key for the data plane (/inference/*, /v1/*); `EMPTY` means none. Prefer "
         "the env variable (a flag shows in `ps`)."),
    Flag("admin_api_key", str, None, "Bearer key for admin routes (pause, weights, LoRA, ...); default: the "
         "--api-key. `EMPTY` means none."),
    Flag("protect_metrics", _bool, False, "Require the data-plane key on /metrics too."),
    Flag("max_stop_token_ids", int, 1024, "Most `stop_token_ids` a request may send (400 beyond)."),
    Flag("max_logit_bias", int, 1024, "Most `logit_bias` entries a request may send (400 beyond)."),
    # --- multimodal requests (content_parts / features; a model directory with a processor and tokenizer)
    Flag("allowed_media_domains", str, None, "Hosts whose http(s) media URLs content_parts may name (repeatable; "
         "vLLM's flag). Unset: no http(s) fetching, only data: URLs.", repeatable=True),
    Flag("allowed_local_media_path", str, None, "Directory whose files content_parts may name as file: URLs "
         "(vLLM's flag). Unset: no local files."),
    Flag("max_mm_items", int, 4, "Most media items (content_parts or features items) per request (400 beyond)."),
    Flag("max_media_bytes", int, 5 * 1024 * 1024, "Largest decoded media item or kwargs_data item (413 beyond)."),
    Flag("max_image_pixels", int, 4096 * 4096, "Most pixels (width x height) of one image (413 beyond)."),
    # --- Dynamo RL discovery (needs the `dynamo` extra; see README "Running under Dynamo")
    Flag("dynamo_namespace", str, None, "Register with Dynamo in this namespace (runs `tito dynamo-register` "
         "beside the server); unset: no Dynamo."),
    Flag("dynamo_component", str, "tito", "Dynamo component name."),
    Flag("dynamo_admin_base_url", str, None, "URL advertised to trainers as admin_base_url (default: "
         "http://<host>:<port>, with this machine's hostname when --host is a wildcard)."),
    # --- HTTP server
    Flag("max_body_bytes", int, 8 * 1024 * 1024, "Largest request body accepted (413 beyond)."),
    Flag("shutdown_timeout", float, 30.0, "Seconds to let in-flight requests finish on SIGTERM before aborting."),
    Flag("liveness_timeout", float, 30.0, "Seconds /liveness waits for its round trip through the engine."),
    Flag("exit_on_engine_death", _bool, True,
         "Exit (code 1) when the engine dies, so a supervisor restarts the server; false stays up for inspection."),
    Flag("engine_death_exit_delay", float, 5.0,
         "Seconds between noticing a dead engine and exiting (clients and probes see the 503 meanwhile)."),
    Flag("log_level", str, "info", "Log level.", choices=("debug", "info", "warning", "error")),
    Flag("log_format", str, "text", "Log line format.", choices=("text", "json")),
    Flag("log_requests", _bool, False, "Log one line per request."),
]

FLAGS_BY_NAME = {f.name: f for f in FLAGS}


@dataclass(frozen=True)
class Settings:
    """Resolved server settings. Build with ``Settings.from_args`` or ``Settings.build``."""

    model: str = DEFAULT_MODEL_DIR
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_logprobs: int = 20
    seed: int = 0
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    enforce_eager: bool | None = None
    gpu_memory_utilization: float | None = None
    num_kv_blocks: int | None = None
    kv_cache_space_gib: float = 1.0
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 4
    max_cpu_loras: int | None = None
    warmup: bool = True
    weight_transfer_backend: str | None = None
    allowed_weight_root: list[str] | None = None
    allow_any_weight_path: bool = False
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    protect_metrics: bool = False
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    allowed_media_domains: list[str] | None = None
    allowed_local_media_path: str | None = None
    max_mm_items: int = 4
    max_media_bytes: int = 5 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    dynamo_namespace: str | None = None
    dynamo_component: str = "tito"
    dynamo_admin_base_url: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    shutdown_timeout: float = 30.0
    liveness_timeout: float = 30.0
    exit_on_engine_death: bool = True
    engine_death_exit_delay: float = 5.0
    log_level: str = "info"
    log_format: str = "text"
    log_requests: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @classmethod
    def build(cls, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults < ``TITO_*`` environment < explicit ``overrides`` (None means "not given")."""
        values = _from_env(os.environ if env is None else env)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def from_args(cls, ns: argparse.Namespace, env: dict[str, str] | None = None) -> Settings:
        return cls.build(env=env, **{f.name: getattr(ns, f.name, None) for f in FLAGS})

    def replace(self, **kw: Any) -> Settings:
        return dataclasses.replace(self, **kw)


def _from_env(env: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in FLAGS:
        raw = env.get(f.env)
        if raw is None:
            continue
        try:
            out[f.name] = [f.type(x) for x in raw.split(",") if x] if f.repeatable else f.type(raw)
        except ValueError as e:
            raise SystemExit(f"invalid {f.env}={raw!r}: {e}") from None
    return out


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Add every server flag. Defaults stay None so the environment can fill them in."""
    for f in FLAGS:
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": f"{f.help} [env {f.env}; default {f.default}]"}
        if f.choices:
            kw["choices"] = f.choices
        if f.repeatable:
            kw["action"] = "append"
            kw["type"] = f.type
        elif f.type is _bool:
            kw["type"] = _bool
            kw["nargs"] = "?"
            kw["const"] = True
            kw["metavar"] = "BOOL"
        else:
            kw["type"] = f.type
        parser.add_argument(f.cli, **kw)


def flags_markdown() -> str:
    """README's flag table, generated from FLAGS."""
    rows = ["| flag | env | default | meaning |", "|---|---|---|---|"]
    for f in FLAGS:
        rows.append(f"| `{f.cli}` | `{f.env}` | `{f.default}` | {f.help} |")
    return "\n".join(rows)
