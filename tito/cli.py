"""``tito`` command line: ``serve``, ``make-tiny-model``, and the client commands for a running server
(``app/client/commands.py``: ``generate``, ``status``, ``drain``, ``update-weights``, ``load-lora``, ...)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, cast


class _TextFormatter(logging.Formatter):
    """``time LEVEL logger: [request id] message`` (the id only on lines about a request)."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if (record.processName or "").startswith("ApiServer_"):  # one of several API processes (--api-server-count)
            head, sep, msg = line.partition(": ")
            line = f"{head} ({record.processName}){sep}{msg}"
        rid = getattr(record, "request_id", None)
        if rid:
            head, sep, msg = line.partition(": ")
            return f"{head}{sep}[{rid}] {msg}" if sep else f"{line} [{rid}]"
        return line


def _setup_logging(level: str, fmt: str) -> None:
    from app.server.reqlog import RequestIdFilter

    if fmt == "json":
        import json
        import time

        class JsonFormatter(logging.Formatter):
            def format(self, record: logging.LogRecord) -> str:
                out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
                       "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
                if (record.processName or "").startswith("ApiServer_"):
                    out["process"] = str(record.processName)
                rid = getattr(record, "request_id", None)
                if rid:
                    out["request_id"] = rid
                if record.exc_info:
                    out["exc"] = self.formatException(record.exc_info)
                return json.dumps(out)

        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger("tito")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def cmd_serve(argv: list[str], own_process: bool = False) -> int:
    """``tito serve ARGV``: vLLM's serve arguments and tito's flags (app/engine/vllm_args.py)."""
    early = None
    if own_process:
        from app.engine.process_start import reexec_with_preload
        from app.engine.vllm_args import engine_start_of

        reexec_with_preload(engine_start_of(argv))  # before PyTorch is imported; see app/engine/process_start.py
        from app.server.early_bind import open_early

        try:
            early = open_early(argv)  # the port answers "starting" while vLLM is imported (app/server/early_bind.py)
        except OSError as e:
            print(f"tito: cannot listen: {e}", file=sys.stderr)
            return 1
    try:
        return _serve(argv, own_process, early)
    finally:
        if early is not None:
            early.close()


def _serve(argv: list[str], own_process: bool, early: Any) -> int:
    from app.engine.engine_setup import check_engine
    from app.engine.vllm_args import ServeArgsError, api_processes, check_frontend, notices, parse_serve

    try:
        settings = parse_serve(argv)
    except ServeArgsError as e:
        print(f"tito: {e}", file=sys.stderr)
        return 2
    processes = api_processes(settings)
    if processes > 1:
        _metrics_of_processes()
    _setup_logging(settings.log_level, settings.log_format)
    if not os.path.isdir(settings.model):
        print(f"tito: model directory {settings.model!r} does not exist "
              f"(make one with: tito make-tiny-model {settings.model})", file=sys.stderr)
        return 2
    try:
        check_frontend(settings)
        check_engine(settings)
    except ServeArgsError as e:
        print(f"tito: {e}", file=sys.stderr)
        return 2
    for line in notices(settings):
        logging.getLogger("tito").info("%s", line)
    from app.server.lifecycle import serve
    from tito.main import create_app

    if processes > 1:
        code = _serve_api_processes(settings, processes, early)
    else:
        # SIGTERM drains (see app/server/lifecycle.py); the exit code is 0 after a clean shutdown, non-zero if the
        # engine died.
        app = create_app(settings)
        _request_log(app, settings)
        sock = early.take(settings.host, settings.port) if early is not None else None
        try:
            code = serve(app, settings, sockets=[sock] if sock is not None else None)
        finally:
            if app.state.sidecar is not None:  # Dynamo's sidecar (app/dynamo/supervisor.py) never outlives the server
                app.state.sidecar.stop_now()
    logging.getLogger("tito").info("server stopped (exit code %d)", code)
    if not own_process:
        return code
    from app.server.lifecycle import exit_now

    exit_now(code)  # no interpreter teardown: Triton's bindings print ~30 lines of "leaked" objects in it


def _request_log(app: Any, settings: Any) -> None:
    if settings.log_requests:
        from app.server.reqlog import RequestLog

        app.add_middleware(RequestLog)  # outermost: times and logs every answer; not mounted at all when off


def _socket(early: Any, settings: Any) -> Any:
    """The listening socket the API processes share: the one bound at launch, or one bound now."""
    from app.server.early_bind import bind

    sock = early.take(settings.host, settings.port) if early is not None else None
    return sock if sock is not None else bind(settings.host, settings.port)


def _metrics_of_processes() -> None:
    """prometheus_client's multiprocess mode (each process's families in files of one directory, summed on a scrape:
    routers/metrics.py), set before any family of tito's or of the engine exists. vLLM's own server does the same
    with several API processes."""
    import atexit
    import shutil
    import tempfile

    from prometheus_client import values

    assert "app.core.metrics" not in sys.modules, "a metric family was made before the multiprocess mode"
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        path = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="tito-metrics-")
        owner = os.getpid()

        def cleanup() -> None:
            if os.getpid() == owner:  # not in a forked process that ran the handlers it inherited
                shutil.rmtree(path, ignore_errors=True)

        atexit.register(cleanup)
    # prometheus_client chose its value class when it was imported (by vLLM's parser): choose again, now.
    values.ValueClass = values.get_value_class()


def _serve_api_processes(settings: Any, processes: int, early: Any) -> int:
    """``--api-server-count`` N > 1: this process is the server's control process; it forks the N API processes
    that serve the port (app/server/api_processes.py), then serves the control plane on its private socket."""
    from app.engine.api_servers import EnginePlan
    from app.server.api_processes import ApiPeers, ControlPeers, Layout, unix_listener
    from app.server.lifecycle import serve, serve_api_process
    from tito.main import create_app

    layout = Layout.make(processes)
    plan = EnginePlan.make(settings, processes)
    peers = ControlPeers(layout, plan, tls=bool(settings.vllm_args.get("ssl_certfile")))

    def api_process(settings: Any, own: ApiPeers, sock: Any) -> int:
        app = create_app(settings, peers=own)
        _request_log(app, settings)
        private = unix_listener(layout.api_socket(own.index))
        return serve_api_process(app, settings, [sock, private], cast(Any, layout.shared.loads), own.index)

    sock = _socket(early, settings)  # the port's early answers stop here: no thread may run across the fork
    peers.fork(settings, sock, api_process)
    sock.close()  # the API processes hold the port
    plan.keep_only(plan.control_index)
    app = create_app(settings, peers=peers)
    _request_log(app, settings)
    try:
        return serve(app, settings, sockets=[unix_listener(layout.control_socket)], tls=False)
    finally:
        if app.state.sidecar is not None:
            app.state.sidecar.stop_now()
        peers.kill()


def cmd_make_tiny_model(ns: argparse.Namespace) -> int:
    if ns.vlm:
        from app.tiny.vlm import make_tiny_vlm

        print(f"tiny vision-language model in {make_tiny_vlm(ns.dir, seed=ns.seed, force=ns.force)}")
        return 0
    from app.tiny.model import make_tiny_model

    out = make_tiny_model(ns.dir, seed=ns.seed, force=ns.force, tokenizer=not ns.no_tokenizer, shape=ns.shape)
    print(f"{'tiny' if ns.shape == 'tiny' else ns.shape + '-shaped'} model in {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tito", description="Token-in/token-out inference server for RL rollouts.")
    sub = p.add_subparsers(dest="command", required=True)

    # `tito serve` is parsed by vLLM's own serve parser (main() hands it over; `tito serve --help` shows it): listed
    # here so that `tito --help` names it without importing vLLM.
    sub.add_parser("serve", help="Serve a model over HTTP: every `vllm serve` argument and tito's own flags "
                   "(tito serve --help).", add_help=False)

    from app.tiny.model import SHAPES  # the model maker's own list (no torch import)

    m = sub.add_parser("make-tiny-model", help="Write the tiny random-weight test model.",
                       description="Write a tiny random-weight Qwen3 (vocab 512, hidden 128, 2 layers), "
                       "deterministic from --seed, offline, with a byte-level BPE tokenizer and a chat template "
                       "(tito's text routes use it: /v1/chat/completions, /tokenize, /detokenize; so does "
                       "Dynamo's frontend; --skip-tokenizer-init serves token ids only).")
    m.add_argument("dir", help="Output directory.")
    m.add_argument("--seed", type=int, default=1234, help="Random seed (default 1234).")
    m.add_argument("--force", action="store_true", help="Overwrite an existing model.")
    m.add_argument("--no-tokenizer", action="store_true",
                   help="Weights and config only (default: also a byte-level BPE tokenizer with a chat template).")
    m.add_argument("--shape", default="tiny", choices=list(SHAPES),
                   help="The architecture: tiny (default, float32), or a Qwen3 size's own (layers, widths, heads, "
                   "vocabulary 151,936, context 40,960, tied head) with random bf16 weights, for benchmarks and the "
                   "seed's run at the shapes users train (0.6b: 1.2 GB, 1.7b: 3.4 GB, 4b: 8 GB, in 2 GB shards).")
    m.add_argument("--vlm", action="store_true", help="Write a tiny vision-language model (Idefics3, with its "
                   "processor and tokenizer) for multimodal requests instead.")
    m.set_defaults(func=cmd_make_tiny_model)

    from app.client.commands import add_client_commands

    add_client_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["serve"]:
            # The command line is this process's own (argv None): `serve` may re-execute it.
            return cmd_serve(args[1:], own_process=argv is None)
        ns = build_parser().parse_args(args)
        return int(ns.func(ns))
    except BrokenPipeError:
        # The reader left (`tito status | head`): not an error. Stdout goes to /dev/null so the flush at exit cannot
        # raise again; 141 is the shell's code for a command ended by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    raise SystemExit(main())
