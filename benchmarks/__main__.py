"""``python -m benchmarks NAME [ARGS]``: run one of tito's benchmarks (``python -m benchmarks NAME --help`` for its
flags); without a name, the list."""

from __future__ import annotations

import argparse
import importlib
import sys

# name: (module, what it measures)
COMMANDS = {
    "serving": ("serving", "tito against the engine in-process and vLLM's server: throughput, CPU per request, "
                "memory (make bench); --vllm-bench: under vLLM's own benchmark client"),
    "updates": ("updates", "weight updates at a real shape with streams running: full, staged delta, broadcast, "
                "vLLM's reload (make bench-updates)"),
    "weights": ("weights", "an update from disk against vLLM's reload on a ~300 MB model; --delta: staged deltas"),
    "control": ("control", "admin calls (pause, resume, health) under load, beside vLLM's server"),
    "http": ("http_layer", "tito's HTTP layer alone on the fake engine, beside a bare ASGI app"),
    "grpc": ("grpc_transports", "gRPC (smg's, vllm.Inference) against HTTP on one tito"),
    "dynamo": ("dynamo_paths", "Dynamo's frontend and sidecar in front of tito against tito's own routes"),
    "transport": ("transport", "CPU per streamed message: grpc.aio, the native gRPC server, a bare socket"),
    "start": ("start", "seconds to healthy, cold and warm compile caches"),
    "api_servers": ("api_servers", "several API processes (--api-server-count) against vLLM's server at the same "
                    "count: tokens/s and the API side's CPU per request"),
    "soak": ("soak", "weight updates under many streams, every answer audited"),
}


def parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of benchmark ``name``."""
    parser_of = importlib.import_module(f"benchmarks.{COMMANDS[name][0]}").parser
    return parser_of()  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        width = max(map(len, COMMANDS))
        for name, (_, what) in COMMANDS.items():
            print(f"  {name:<{width}}  {what}")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"unknown benchmark {argv[0]!r}: one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{COMMANDS[argv[0]][0]}")
    return int(module.main(argv[1:]))


if __name__ == "__main__":
    raise SystemExit(main())
