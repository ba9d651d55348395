"""``tito serve``'s command line: vLLM's own ``vllm serve`` arguments, with tito's flags beside them.

The parser is vLLM's (``make_arg_parser``: every OpenAI-front-end and engine argument of ``vllm serve``, with vLLM's
names, types, JSON and ``--no-`` forms, ``--config`` files and ``--help=<group>`` pages), so a vLLM upgrade brings its
new arguments with it. tito adds its own flags as one more group; a tito setting that vLLM also defines (``--port``,
``--dtype``, ``--max-logprobs``, ...) is vLLM's one argument, read into ``Settings`` (and its ``TITO_*`` variable
still works). Only what the command line names is kept: every other value is tito's default or vLLM's.

Where each argument goes (``route``): engine arguments to ``AsyncEngineArgs``; front-end arguments to vLLM's OpenAI
handlers (``frontend_options``) or tito's HTTP server; the few tito cannot honour are refused at start by name, with
the reason (``refusals``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from functools import cache
from typing import TYPE_CHECKING, Any

from app.core.settings import FLAGS, Flag, Settings, add_server_flags, tito_flag_help

if TYPE_CHECKING:
    from vllm.utils.argparse_utils import FlexibleArgumentParser


class ServeArgsError(ValueError):
    """An argument ``tito serve`` refuses: the message names it and says why (the command exits 2)."""


class _Unset:
    def __repr__(self) -> str:
        return "<not given>"


_UNSET = _Unset()

# Front-end arguments (vLLM's FrontendArgs and make_arg_parser's own) that tito honours: its HTTP server's
# (host, port, keys, TLS, CORS, root path, middleware, docs, h11 limits, access log) or vLLM's OpenAI handlers'.
HANDLER_OPTIONS = frozenset({
    "chat_template", "chat_template_content_format", "trust_request_chat_template", "trust_request_mm_kwargs",
    "default_chat_template_kwargs", "response_role", "return_tokens_as_token_ids", "enable_auto_tool_choice",
    "exclude_tools_when_tool_choice_none", "tool_call_parser", "tool_parser_plugin", "tool_strict_level",
    "max_log_len", "enable_prompt_tokens_details", "enable_per_request_metrics", "enable_force_include_usage",
    "enable_log_outputs", "enable_log_deltas", "anthropic_disabled_thinking_effort", "log_error_stack",
    "fingerprint_mode", "fingerprint_value", "cohere_format",
})
SERVER_OPTIONS = frozenset({
    "host", "port", "api_key", "grpc_port", "uvicorn_log_level", "disable_uvicorn_access_log",
    "disable_access_log_for_endpoints", "allow_credentials", "allowed_origins", "allowed_methods", "allowed_headers",
    "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "ssl_ciphers", "root_path", "middleware",
    "enable_request_id_headers", "disable_fastapi_docs", "h11_max_incomplete_event_size", "h11_max_header_count",
    "model_tag", "config", "enable_scale_out", "enable_flash_late_interaction", "lora_modules",
})
# Front-end arguments tito does not serve, refused when given with a value other than vLLM's default: why.
REFUSED = {
    "headless": "tito is an API server; a headless engine has no API (run `vllm serve --headless` for that node)",
    "grpc": "tito serves HTTP always, and gRPC beside it on --grpc-port",
    "uds": "tito listens on --host/--port (its clients, Dynamo's sidecar and the admin URL it publishes need them)",
    "enable_ssl_refresh": "tito loads the TLS files once at start",
    "tokens_only": "tito serves the token API together with the text routes; use --skip-tokenizer-init for a "
                   "tokens-only server",
    "tool_server": "tito's /v1/responses runs without built-in tool servers",
    "enable_server_load_tracking": "tito reports load as tito_requests_in_flight on /metrics",
    "enable_tokenizer_info_endpoint": "tito does not serve /tokenizer_info",
    "enable_offline_docs": "tito serves FastAPI's own /docs",
    "sse_keep_alive_interval": "tito's streams send no keep-alive comments",
    "cohere_is_reasoning_model": "tito does not serve Cohere's /cohere/v2/chat",
    "data_parallel_supervisor_port": "tito does not run vLLM's multi-port external load balancer",
    "dp_supervisor_probe_interval_s": "tito does not run vLLM's multi-port external load balancer",
    "dp_supervisor_probe_timeout_s": "tito does not run vLLM's multi-port external load balancer",
    "dp_supervisor_probe_failure_threshold": "tito does not run vLLM's multi-port external load balancer",
    # Engine arguments that would take away what tito's own features stand on.
    "disable_log_stats": "tito's /metrics and its readiness read the engine's statistics",
    "data_parallel_multi_port_external_lb": "tito runs one API server for all its data-parallel ranks",
}
# A tito flag that sets part of one of vLLM's arguments: never both (they could disagree).
SHORTHANDS = {"num_kv_blocks": "num_gpu_blocks_override", "kv_events_port": "kv_events_config",
              "weight_transfer_backend": "weight_transfer_config"}
# Worker extensions a trainer's launcher names for the update routes it adds to vLLM; tito serves those routes itself.
TRAINER_EXTENSIONS = ("prime_rl.", "areal.")
# Architectures built on vLLM's DeepseekV2MoE, the gate Prime-RL's additional_config.fp32_router_logits patches.
FP32_ROUTER_MODELS = ("Deepseek", "GlmMoeDsa", "Glm4MoeLite", "KimiK2", "MistralLarge3", "LongcatFlash")

SERVE_DESCRIPTION = (
    "Serve a model over HTTP (and gRPC with --grpc-port). Takes every argument of `vllm serve` (vLLM's names, types "
    "and parsing; see https://docs.vllm.ai/en/latest/cli/serve.html) and tito's own flags (the `tito` group; each "
    "also reads its TITO_* environment variable). `--help=<group>` shows one group, `--help=all` every argument, "
    "`--help=<word>` the arguments whose names contain it.")


@cache
def serve_parser() -> FlexibleArgumentParser:
    """vLLM's ``vllm serve`` parser with tito's flags added (built once: it imports vLLM)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="tito serve", description=SERVE_DESCRIPTION)
    make_arg_parser(parser)
    vllm_actions = {a.dest: a for a in parser._actions}
    vllm_actions["log_level"].type = str.upper  # tito's `--log-level info` (vLLM's choices are upper case)
    for f in FLAGS:
        if f.name in vllm_actions:  # one argument, vLLM's: tito's default and variable named in its help
            a = vllm_actions[f.name]
            a.help = f"{a.help or ''} [tito: {tito_flag_help(f)}]".lstrip()
    group = parser.add_argument_group("tito", "tito's own flags; each also reads TITO_<NAME>.")
    add_server_flags(group, skip=set(vllm_actions))
    _TITO_ONLY.update(a.dest for a in group._group_actions)
    return parser


_TITO_ONLY: set[str] = set()  # the dests of tito's own flags in serve_parser() (the rest are vLLM's)


def vllm_defaults() -> dict[str, Any]:
    """Every argument's default, as ``vllm serve`` has it (None where vLLM leaves it unset)."""
    actions = serve_parser()._actions
    return {a.dest: None if a.default == argparse.SUPPRESS else a.default for a in actions
            if a.dest != "help" and a.dest not in _TITO_ONLY}


def parse_given(argv: list[str]) -> dict[str, Any]:
    """The arguments the command line gives, parsed by vLLM's rules (only those: defaults are left out)."""
    parser = serve_parser()
    # Each argument starts as "not given"; the actions that add to the value they find (append, count) start empty.
    adding = (argparse._AppendAction, argparse._ExtendAction, argparse._CountAction)
    ns = argparse.Namespace(**{a.dest: None if isinstance(a, adding) else _UNSET for a in parser._actions
                               if a.dest != "help"})
    parsed = parser.parse_args(argv, namespace=ns)
    unset = {a.dest for a in parser._actions if isinstance(a, adding) and getattr(parsed, a.dest) is None}
    given = {k: v for k, v in vars(parsed).items() if v is not _UNSET and k not in unset}
    if given.get("model_tag") is None:
        given.pop("model_tag", None)
    return given


def _settings_value(f: Flag, v: Any) -> Any:
    if f.repeatable and v is not None and not isinstance(v, list):
        return [v]
    return v


def parse_serve(argv: list[str], env: dict[str, str] | None = None) -> Settings:
    """``tito serve ARGV`` as ``Settings``: tito's flags (command line > TITO_* > default) and ``vllm_args``, the
    vLLM arguments given that are not tito settings. Raises ``ServeArgsError`` for an argument tito refuses."""
    given = parse_given(argv)
    if "model_tag" in given:  # `tito serve MODEL`, as `vllm serve MODEL`
        tag = given.pop("model_tag")
        if "model" in given and given["model"] != tag:
            raise ServeArgsError(f"the model is given twice: {tag!r} and --model {given['model']!r}")
        given["model"] = tag
    names = {f.name: f for f in FLAGS}
    own = {k: _settings_value(names[k], v) for k, v in given.items() if k in names}
    rest = {k: v for k, v in given.items() if k not in names}
    if "log_level" in own:  # one argument: tito's log level and vLLM's logging config (an engine argument)
        rest["log_level"] = own["log_level"] = own["log_level"].upper()
    for flag_name, arg in SHORTHANDS.items():
        if flag_name in own and arg in rest:
            short, full = flag_name.replace("_", "-"), arg.replace("_", "-")
            raise ServeArgsError(f"--{short} is a shorthand for part of --{full}: give one of them")
    settings = Settings.build(env=env, vllm_args=rest, **own)
    if problems := refusals(settings):
        raise ServeArgsError(problems[0])
    return settings


def refusals(settings: Settings) -> list[str]:
    """Why tito cannot honour an argument it was given, one line each (empty when it can honour them all)."""
    defaults = vllm_defaults()
    out = []
    for name, value in settings.vllm_args.items():
        if name in REFUSED and value != defaults.get(name):
            out.append(f"--{name.replace('_', '-')} is not supported by tito: {REFUSED[name]}")
    if settings.vllm_args.get("lora_modules") and not settings.enable_lora:
        out.append("--lora-modules needs --enable-lora")
    for module in settings.vllm_args.get("lora_modules") or ():
        if getattr(module, "base_model_name", None) not in (None, settings.model_name, settings.model):
            out.append(f"--lora-modules {module.name}: base_model_name {module.base_model_name!r} is not the "
                       f"served model ({settings.model_name!r})")
    if settings.api_server_count is not None and settings.api_server_count < 1:
        out.append(f"--api-server-count {settings.api_server_count} is not supported by tito: tito is an API server "
                   "(a headless engine has no API; run `vllm serve --headless` for that node)")
    if (settings.vllm_args.get("additional_config") or {}).get("fp32_router_logits") and \
            any(a.startswith(FP32_ROUTER_MODELS) for a in _architectures(settings.model)):
        out.append("--additional-config fp32_router_logits is not supported by tito: Prime-RL's fp32 router logits "
                   "for DeepSeek-family gates are its own vLLM patch (upstream in vLLM after 0.32); leave it out, or "
                   "serve this model with Prime-RL's server")
    head = ((settings.vllm_args.get("hf_overrides") or {}).get("head_dtype") or "float32")
    if (settings.vllm_args.get("additional_config") or {}).get("fp32_lm_head") and head != "float32":
        out.append(f"additional_config.fp32_lm_head asks for an fp32 LM head but --hf-overrides sets head_dtype="
                   f"{head!r}")
    ext = settings.vllm_args.get("worker_extension_cls")
    if ext and not str(ext).startswith(TRAINER_EXTENSIONS):
        out.append(f"--worker-extension-cls {ext} is not supported by tito: tito's own worker extension carries its "
                   "weight updates, broadcasts and LoRA checks (and serves Prime-RL's and AReaL's update routes)")
    return out


def notices(settings: Settings) -> list[str]:
    """What tito says at start about the arguments it takes differently from vLLM's server (logged once)."""
    out = []
    if ext := settings.vllm_args.get("worker_extension_cls"):
        out.append(f"--worker-extension-cls {ext}: not loaded; tito's own worker extension serves the trainer's "
                   "update routes (/update_weights, /init_broadcaster, AReaL's /areal_*)")
    if (settings.vllm_args.get("additional_config") or {}).get("fp32_router_logits"):
        arch = ", ".join(_architectures(settings.model)) or "unknown"
        out.append(f"additional_config.fp32_router_logits: no MoE router in this model ({arch}) that Prime-RL's "
                   "switch changes (it acts on DeepSeek-family gates only), nothing to do")
    return out


def _architectures(model_dir: str) -> list[str]:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return [str(a) for a in json.load(f).get("architectures") or ()]
    except (OSError, ValueError):
        return []


def engine_options(settings: Settings) -> dict[str, Any]:
    """The given vLLM arguments that are engine arguments (``AsyncEngineArgs`` fields), with Prime-RL's
    ``additional_config`` switches turned into what vLLM itself reads."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    out = {k: v for k, v in settings.vllm_args.items() if k in fields}
    extra = out.get("additional_config") or {}
    if extra.get("fp32_lm_head"):
        # Prime-RL's switch for an fp32 LM head (its own vLLM patch) is vLLM 0.32's head_dtype override (a conflicting
        # override is refused at start: ``refusals``).
        out["hf_overrides"] = {**(out.get("hf_overrides") or {}), "head_dtype": "float32"}
    return out


def frontend_options(settings: Settings) -> argparse.Namespace:
    """vLLM's front-end options for its OpenAI handlers: vLLM's defaults, the given ones over them."""
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    values: dict[str, Any] = {}
    for f in dataclasses.fields(FrontendArgs):
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
    values.update({k: v for k, v in settings.vllm_args.items() if k in values})
    return argparse.Namespace(**values, given=frozenset(settings.vllm_args))


def load_plugins(settings: Settings) -> None:
    """What ``vllm serve`` imports before it builds its handlers: a tool-parser plugin."""
    if plugin := settings.vllm_args.get("tool_parser_plugin"):
        from vllm.tool_parsers import ToolParserManager

        ToolParserManager.import_tool_parser(plugin)


def check_frontend(settings: Settings) -> None:
    """vLLM's own start-up checks of the front-end arguments (the chat template, auto tool choice's parser)."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.tool_parsers import ToolParserManager

    ns = frontend_options(settings)
    defaults = vllm_defaults()
    for k in ("grpc", "headless", "data_parallel_multi_port_external_lb", "enable_log_requests",
              "disable_log_stats"):
        setattr(ns, k, settings.vllm_args.get(k, defaults.get(k)))
    ns.api_server_count = settings.api_server_count
    ns.grpc_port = None  # tito's --grpc-port is its own gRPC server, not vLLM's Rust front end's
    try:
        validate_parsed_serve_args(ns)
    except (TypeError, ValueError) as e:
        raise ServeArgsError(str(e).removeprefix("Error: ")) from None
    load_plugins(settings)
    parser = ns.tool_call_parser
    if parser and parser not in ToolParserManager.list_registered():
        raise ServeArgsError(f"--tool-call-parser {parser!r} is not a tool parser vLLM knows (registered: "
                             f"{', '.join(sorted(ToolParserManager.list_registered()))})")


def api_processes(settings: Settings) -> int:
    """How many API processes serve the port: ``--api-server-count``, else vLLM's default (``vllm serve``'s
    ``ServeSubcommand.cmd``): 1 behind an external load balancer, the local data-parallel size in hybrid mode, the
    data-parallel size otherwise."""
    if settings.api_server_count is not None:
        return settings.api_server_count
    v = settings.vllm_args
    if v.get("data_parallel_external_lb") or v.get("data_parallel_rank") is not None:
        return 1
    if v.get("data_parallel_hybrid_lb") or v.get("data_parallel_start_rank") is not None:
        return int(v.get("data_parallel_size_local") or 1)
    return settings.data_parallel_size


def namespace_argv(values: dict[str, Any]) -> list[str]:
    """A launcher's vLLM namespace (Prime-RL's ``InferenceConfig.to_namespace()`` hands vLLM's parser one instead of a
    command line) as the command line vLLM's parser reads back the same. Attributes that vLLM's parser does not know
    (a launcher's own, such as Prime-RL's ``liveness_timeout_seconds``) and None values are left out."""
    argv: list[str] = []
    actions = {a.dest: a for a in serve_parser()._actions if a.option_strings and a.dest not in _TITO_ONLY}
    for key, value in values.items():
        a = actions.get(key)
        if a is None or value is None:
            continue
        flag = next(o for o in a.option_strings if o.startswith("--") and not o.startswith("--no-"))
        if isinstance(a, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        elif a.nargs == 0:
            argv += [flag] if value else []
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def engine_start_of(argv: list[str], env: dict[str, str] | None = None) -> str:
    """``--engine-start`` read before anything imports vLLM (``tito serve`` may restart itself on it)."""
    for i, a in enumerate(argv):
        if a.startswith("--engine-start="):
            return a.split("=", 1)[1]
        if a in ("--engine-start", "--engine_start") and i + 1 < len(argv):
            return argv[i + 1]
    return (os.environ if env is None else env).get("TITO_ENGINE_START", "fork")
