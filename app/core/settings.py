"""Every server flag and ``TITO_*`` environment variable, declared once: the fields of ``Settings``.

A field made with ``flag(default, help)`` is a server flag: the CLI (``--name-with-dashes``), the environment reader
(``TITO_NAME``) and the docs' flag table (docs/reference/flags.md) are all derived from it, its type from the
annotation. Precedence: command-line flag > ``TITO_<NAME>`` environment variable > default.

Adding a flag is one line in ``Settings``, e.g. ``grpc_port: int | None = flag(None, "gRPC port (unset: no gRPC).")``,
then ``python scripts/gen_reference.py`` to refresh the docs' table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL_DIR = "models/tiny-qwen3"


def _bool(v: str) -> bool:
    s = v.strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {v!r}")


def flag(default: Any, help: str, *, choices: tuple[str, ...] | None = None, secret: bool = False) -> Any:  # noqa: A002
    """A ``Settings`` field that is also a server flag. ``secret``: kept out of ``repr`` (keys)."""
    return field(default=default, repr=not secret, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class Settings:
    """Resolved server settings. Build with ``Settings.build``, or from a command line with
    ``app.engine.vllm_args.parse_serve``."""

    # --- where and what to serve
    model: str = flag(DEFAULT_MODEL_DIR, "Model directory (HF layout: config.json + safetensors); also the first "
                      "positional argument, as `vllm serve MODEL`. Default: the tiny model `make serve` writes (vLLM's "
                      "names a hub model, which tito never downloads).")
    host: str = flag("127.0.0.1", "Address to bind (vLLM's default: every interface; tito's: loopback, since its "
                     "admin routes replace the served weights; give 0.0.0.0 and keys to serve a network).")
    port: int = flag(8000, "Port to bind.")
    served_model_name: list[str] | None = flag(
        None, "Names clients use in `model`, the first one reported (default: the --model value).")
    # --- engine
    dtype: str = flag("auto", "Weight/activation dtype (auto, float32, bfloat16, float16).")
    max_model_len: int | None = flag(None, "Context length (default: the model's).")
    max_num_seqs: int | None = flag(None, "Max concurrent sequences in a batch (default: vLLM's).")
    max_logprobs: int = flag(20, "Largest `logprobs`/`prompt_logprobs` a request may ask for.")
    seed: int = flag(0, "Engine random seed.")
    data_parallel_size: int = flag(1, "Number of engine cores (vLLM data parallel) behind this server.")
    api_server_count: int | None = flag(
        None, "API processes serving the port, each a client of the same engine cores, with one control plane "
        "(docs/guides/operations.md, \"Several API processes\"). Default: vLLM's, the data-parallel size.")
    tensor_parallel_size: int = flag(1, "Tensor parallel size per engine core.")
    enable_prefix_caching: bool = flag(True, "Reuse KV of shared prompt prefixes.")
    scheduling_policy: str = flag("fcfs", "fcfs, or priority to honour the request `priority`.",
                                  choices=("fcfs", "priority"))
    enforce_eager: bool | None = flag(
        None, "Run the model eagerly, without torch.compile and CUDA graphs. Default: off, as vLLM (at Qwen3-0.6B's "
        "shape on CPU compiled decodes 13-16% faster, docs/benchmarks 2026-12-04); a compiled start costs more (the "
        "first start of a shape compiles for minutes at real shapes, vLLM caches it): --enforce-eager for quick "
        "starts on small models. On CPU --enable-return-routed-experts implies it.")
    gpu_memory_utilization: float | None = flag(
        None, "Fraction of device memory for vLLM (CPU: of the NUMA node's RAM; default 0.3 on CPU, vLLM's 0.92 on "
        "GPU).")
    num_kv_blocks: int | None = flag(
        None, "Fix the number of KV cache blocks (vLLM's num_gpu_blocks_override): caps KV memory exactly; small "
        "values make the scheduler preempt under load.")
    kv_cache_space_gib: float = flag(1.0, "CPU only: GiB of KV cache (sets VLLM_CPU_KVCACHE_SPACE if unset).")
    block_size: int | None = flag(None, "Tokens per KV cache block (default: vLLM's; 128 on CPU, where it must be a "
                                  "multiple of 32).")
    kv_events_port: int | None = flag(
        None, "Publish KV-cache events (vLLM's ZMQ publisher) on this port, data-parallel rank r on port+r (replay "
        "buffer on port+DP+r), for Dynamo's KV router and gRPC SubscribeKvEvents; 0 picks free ports. Unset: off.")
    engine_start: str = flag(
        "fork", "CPU: how the engine core and worker processes start. fork: from the server process, sharing its "
        "imports (about half the start time and CPU of spawn); `tito serve` restarts itself once at launch with the "
        "libraries vLLM preloads into its processes. spawn: vLLM's CPU default, each process imports vLLM anew. "
        "Other platforms: vLLM's choice.", choices=("fork", "spawn"))
    enable_lora: bool = flag(False, "Serve LoRA adapters.")
    max_lora_rank: int = flag(16, "Largest LoRA rank an adapter may have.")
    max_loras: int = flag(4, "LoRA adapters in one batch (vLLM's default 1; tito's 4: an RL run serves several "
                          "policies' adapters side by side).")
    max_cpu_loras: int | None = flag(None, "LoRA adapters kept in host memory (default: max_loras).")
    enable_return_routed_experts: bool = flag(
        False, "Return each token's routed MoE experts (vLLM's --enable-return-routed-experts; Prime-RL's router "
        "replay reads them from `routed_experts`). On CPU through tito's fix to vLLM's CPU runner: eager, forked "
        "engine processes, one engine (refused at start otherwise).")
    routed_experts_format: str = flag("prime-rl", "`routed_experts` on /inference/v1/generate: `prime-rl` ({data, shape, start, dtype}, what Prime-RL's server sends and its renderers/verifiers decode) or `npy` (vLLM's base64 .npy).", choices=("prime-rl", "npy"))  # noqa: E501
    lora_keep_versions: int = flag(
        2, "Versioned LoRA names <name>-v<N> (AReaL loads one per step and never unloads): keep the newest N "
        "versions of each name, unload older ones (freed in the engine once no request is in flight); 0 keeps all.")
    stream_interval: int = flag(1, "Tokens per streamed event (vLLM's stream_interval): 1 sends every engine step's "
                                "tokens at once; N > 1 fewer, larger events (the first and last still at once).")
    skip_tokenizer_init: bool | None = flag(
        None, "Serve tokens only: do not load the model directory's tokenizer (default: loaded when the directory "
        "has one; the text routes, /v1/chat/completions, /tokenize and text prompts, then answer 400).")
    warmup: bool = flag(True, "Run one real generation before reporting ready.")
    weight_transfer_backend: str | None = flag(
        None, "vLLM weight-transfer backend for /init_weight_transfer_engine (nccl, ipc, ...; all need a GPU).")
    # --- staged weight updates (/stage*, /commit; see docs/guides/staged-deltas.md)
    staging_dir: str | None = flag(None, "Where staged versions and uploads are kept (a fresh subdirectory per server, "
                                   "removed at exit; default: the system temp directory).")
    state_dir: str | None = flag(
        None, "Where tito records the weights it last committed (version, weight directory, staged full version and "
        "the deltas on top), restored at start before it reports ready or joins discovery, so a restarted replica "
        "never serves stale weights. Default: $XDG_STATE_HOME/tito/<port>-<hash of --model> (~/.local/state when "
        "unset); on Kubernetes mount a volume that outlives the container (emptyDir) there. `off`: no record (a "
        "restart serves --model's weights).")
    max_staged_versions: int = flag(2, "Staged versions kept on disk (staging another drops the oldest); uploads in "
                                    "progress: twice that, at least 4.")
    max_stage_bytes: int = flag(16 * 1024**3, "Largest staged upload (a file, or the total of its chunks): 413 beyond.")
    stage_ready_wait: float = flag(30.0, "Seconds a delta's stage call may wait, after its check, for the workers to "
                                   "make it ready for its commit (CPU: its layers processed while generating); past "
                                   "it the stage answers `ready: false` and the commit finishes the work under the "
                                   "pause. 0: answer at once.")
    delta_copy: str = flag(
        "memory", "Where each worker keeps its copy of the weights a staged delta is added to (the ones its model "
        "cannot give back: on CPU the linear layers' weights, which processing re-packs and drops, 0.88 GB at "
        "Qwen3-0.6B's shape, 7.3 GB at 4B's; nothing on CUDA): `memory`, or `file`: a file under --staging-dir, "
        "memory-mapped (page cache the kernel may drop under memory pressure, at the cost of writing it back; RSS "
        "counts it while resident, anonymous memory does not).", choices=("memory", "file"))
    stage_timeout: float = flag(600.0, "Seconds a stage's check of a delta, or a commit's apply in the workers, may "
                                "take: 504 beyond (a commit that timed out leaves the weights inconsistent).")
    # --- security
    allowed_weight_root: list[str] | None = flag(
        None, "Directory that weight_dir/lora_path may resolve into (repeatable; default: the model's parent and the "
        "working directory).")
    allow_any_weight_path: bool = flag(False, "Let requests load weights from any path (unsafe).")
    api_key: list[str] | None = flag(
        None, "Bearer key(s) for the data plane (/inference/*, /v1/*); `EMPTY` means none. Prefer the env variable "
        "(a flag shows in `ps`).", secret=True)
    admin_api_key: str | None = flag(None, "Bearer key for admin routes (pause, weights, LoRA, ...); default: the "
                                     "--api-key. `EMPTY` means none.", secret=True)
    protect_metrics: bool = flag(False, "Require the data-plane key on /metrics too.")
    max_stop_token_ids: int = flag(1024, "Most `stop_token_ids` a request may send (400 beyond).")
    max_logit_bias: int = flag(1024, "Most `logit_bias` entries a request may send (400 beyond).")
    # --- multimodal requests (content_parts / features; a model directory with a processor and tokenizer)
    allowed_media_domains: list[str] | None = flag(
        None, "Hosts whose http(s) media URLs content_parts may name (repeatable; vLLM's flag). Unset: no http(s) "
        "fetching, only data: URLs.")
    allowed_local_media_path: str | None = flag(
        None, "Directory whose files content_parts may name as file: URLs (vLLM's flag). Unset: no local files.")
    max_mm_items: int = flag(4, "Most media items (content_parts or features items) per request (400 beyond).")
    max_media_bytes: int = flag(5 * 1024 * 1024, "Largest decoded media item or kwargs_data item (413 beyond).")
    max_image_pixels: int = flag(4096 * 4096, "Most pixels (width x height) of one image (413 beyond).")
    # --- Dynamo (needs the `dynamo` extra and ai-dynamo; see docs/guides/dynamo.md)
    dynamo_namespace: str | None = flag(None, "Run Dynamo's vLLM sidecar (python -m dynamo.vllm.sidecar) beside the "
                                        "server, registered in this namespace; needs --grpc-port. Unset: no Dynamo "
                                        "(the sidecar can also be started by hand).")
    dynamo_component: str = flag("backend", "Dynamo component the sidecar registers (the sidecar's own default: a "
                                 "replica whose sidecar was started by hand joins the same worker set).")
    dynamo_admin_base_url: str | None = flag(
        None, "tito's URL for trainers (the sidecar's --vllm-http-endpoint, admin_base_url in /v1/rl/workers; "
        "default: http://<host>:<port>, with this machine's hostname when --host is a wildcard).")
    dynamo_system_port: int | None = flag(
        None, "The sidecar's system port (DYN_SYSTEM_PORT, below 32768): engine-control routes and RL discovery "
        "(--enable-rl). Default: DYN_SYSTEM_PORT from the environment, else none.")
    # --- gRPC (needs the `grpc` extra; see docs/guides/grpc.md)
    grpc_port: int | None = flag(None, "Also serve gRPC on this port: smg's VllmEngine and vLLM's native vllm.Control "
                                 "+ vllm.Inference (Dynamo's vLLM sidecar), health, reflection; same engine and "
                                 "admission as HTTP; unset: no gRPC.")
    grpc_server: str = flag(
        "native", "The gRPC server under those services: `native` (pygrpc-native: HTTP/2 and gRPC framing in Rust "
        "threads, about half grpcio's CPU per streamed message) or `grpcio` (grpc.aio).", choices=("native", "grpcio"))
    grpc_trust_loopback: bool = flag(True, "With API keys set, vllm.Control / vllm.Inference calls from a loopback "
                                     "peer need no key (the Dynamo sidecar beside tito sends none); others always do.")
    # --- HTTP server
    max_body_bytes: int = flag(8 * 1024 * 1024, "Largest request body accepted (413 beyond).")
    pause_lease: float = flag(
        0.0, "Default lease of a /pause (seconds; /pause?lease= overrides): resume by itself when no control call "
        "comes for that long; 0: none, a pause lasts until /resume.")
    shutdown_timeout: float = flag(30.0, "Seconds to let in-flight requests finish on SIGTERM before aborting "
                                   "(vLLM's default 0 aborts at once; tito drains, as a replica leaving a fleet "
                                   "should).")
    liveness_timeout: float = flag(30.0, "Seconds /liveness waits for its round trip through the engine.")
    exit_on_engine_death: bool = flag(
        True, "Exit (code 1) when the engine dies, so a supervisor restarts the server; false stays up for "
        "inspection.")
    engine_death_exit_delay: float = flag(
        5.0, "Seconds between noticing a dead engine and exiting (clients and probes see the 503 meanwhile).")
    log_level: str = flag("info", "Log level, of tito's log and of vLLM's (vLLM's --log-level).",
                          choices=("debug", "info", "warning", "error"))
    log_format: str = flag("text", "Log line format.", choices=("text", "json"))
    log_requests: bool = flag(False, "Log one line per request.")
    # Not a flag: the vLLM arguments given that are not tito settings (app/engine/vllm_args.py routes them to the
    # engine, vLLM's OpenAI handlers or tito's HTTP server).
    vllm_args: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_name[0] if self.served_model_name else self.model

    @classmethod
    def build(cls, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults < ``TITO_*`` environment < explicit ``overrides`` (None means "not given")."""
        values = _from_env(os.environ if env is None else env)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self, **kw: Any) -> Settings:
        return dataclasses.replace(self, **kw)


# ------------------------------------------------------------------------------- derived from the Settings fields

_PARSERS: dict[str, Callable[[str], Any]] = {"str": str, "int": int, "float": float, "bool": _bool}


@dataclass(frozen=True)
class Flag:
    """A server flag, derived from its ``Settings`` field."""

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

    @classmethod
    def of(cls, f: dataclasses.Field[Any]) -> Flag:
        # Annotations are strings here (``from __future__ import annotations``): "int | None", "list[str] | None".
        base = str(f.type).removesuffix(" | None")
        repeatable = base.startswith("list[")
        parse = _PARSERS[base.removeprefix("list[").removesuffix("]") if repeatable else base]
        return cls(f.name, parse, f.default, f.metadata["help"], f.metadata["choices"], repeatable)


FLAGS: list[Flag] = [Flag.of(f) for f in dataclasses.fields(Settings) if "help" in f.metadata]


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


def tito_flag_help(f: Flag) -> str:
    return f"env {f.env}; default {f.default}"


def add_server_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, skip: Collection[str] = ()) -> None:
    """Add the server flags (but those named in ``skip``). Defaults stay None so the environment can fill them in."""
    for f in FLAGS:
        if f.name in skip:
            continue
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": f"{f.help} [{tito_flag_help(f)}]"}
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


def flags_markdown(vllm_defaults: dict[str, Any] | None = None) -> str:
    """The docs' flag table (docs/reference/flags.md), generated from the Settings fields. ``vllm_defaults``: the
    defaults of the flags that are also vLLM arguments (one argument, vLLM's parsing; app/engine/vllm_args.py)."""
    vllm = vllm_defaults or {}
    rows = ["| flag | env | default | meaning | vLLM's argument (its default) |", "|---|---|---|---|---|"]
    for f in FLAGS:
        theirs = f"yes (`{vllm[f.name]}`)" if f.name in vllm else ""
        rows.append(f"| `{f.cli}` | `{f.env}` | `{f.default}` | {f.help} | {theirs} |")
    return "\n".join(rows)
