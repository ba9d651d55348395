"""``tito`` command line: ``serve`` and ``make-tiny-model`` (more commands grow here)."""

from __future__ import annotations

import argparse
import logging
import sys

from app.settings import Settings, add_server_flags


def _setup_logging(level: str, fmt: str) -> None:
    if fmt == "json":
        import json
        import time

        class JsonFormatter(logging.Formatter):
            def format(self, record: logging.LogRecord) -> str:
                out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
                       "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
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
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("tito")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def cmd_serve(ns: argparse.Namespace) -> int:
    import os

    import uvicorn

    settings = Settings.from_args(ns)
    _setup_logging(settings.log_level, settings.log_format)
    if not os.path.isdir(settings.model):
        print(f"tito: model directory {settings.model!r} does not exist "
              f"(make one with: tito make-tiny-model {settings.model})", file=sys.stderr)
        return 2
    from app.main import create_app

    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        # Longer than any client's idle keep-alive: a server closing an idle connection just as the client reuses
        # it is how vLLM's own server "drops" requests (ServerDisconnectedError).
        timeout_keep_alive=120,
        timeout_graceful_shutdown=int(settings.shutdown_timeout) or None,
    )
    return 0


def cmd_make_tiny_model(ns: argparse.Namespace) -> int:
    from app.tiny_model import make_tiny_model

    out = make_tiny_model(ns.dir, seed=ns.seed, force=ns.force)
    print(f"tiny model in {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tito", description="Token-in/token-out inference server for RL rollouts.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="Serve a model over HTTP.", description="Serve a model over HTTP. Every flag "
                       "can also be set with its TITO_* environment variable.")
    add_server_flags(s)
    s.set_defaults(func=cmd_serve)

    m = sub.add_parser("make-tiny-model", help="Write the tiny random-weight test model.",
                       description="Write a tiny random-weight Qwen3 (vocab 512, hidden 128, 2 layers), "
                       "deterministic from --seed, offline.")
    m.add_argument("dir", help="Output directory.")
    m.add_argument("--seed", type=int, default=1234, help="Random seed (default 1234).")
    m.add_argument("--force", action="store_true", help="Overwrite an existing model.")
    m.set_defaults(func=cmd_make_tiny_model)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return int(ns.func(ns))


if __name__ == "__main__":
    raise SystemExit(main())
