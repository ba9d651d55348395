"""Regenerate tito's Python modules for vLLM's native gRPC services from ``app/grpc/proto/*.proto``.

The generated modules are committed (``app/grpc/proto/*_pb2*.py``), so serving needs no code generator; this script
needs ``grpcio-tools`` (the ``test`` extra). ``--check`` regenerates into a temporary directory and exits 1 when the
committed modules differ (tests/test_sidecar_unit.py runs it).

    python scripts/gen_protos.py            # rewrite app/grpc/proto/*_pb2*.py
    python scripts/gen_protos.py --check    # are they up to date?
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "app" / "grpc" / "proto"
PACKAGE = "app.grpc.proto"


def generate(out: Path) -> list[Path]:
    """Run protoc on every .proto in app/grpc/proto into ``out``; returns the files written."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    protos = sorted(p.name for p in PROTO_DIR.glob("*.proto"))
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = sorted(p for p in out.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))
    # protoc writes `import x_pb2` (a top-level module); inside the package it must be `from app.grpc.proto import ...`.
    stems = [Path(p).stem for p in protos]
    for f in written:
        text = f.read_text()
        for stem in stems:
            text = re.sub(rf"^import {stem}_pb2 as ", f"from {PACKAGE} import {stem}_pb2 as ", text, flags=re.M)
        f.write_text(text)
    return written


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the committed modules instead of writing")
    ns = p.parse_args()
    if not ns.check:
        for f in generate(PROTO_DIR):
            print(f"wrote {f.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [f.name for f in generate(Path(tmp)) if not (PROTO_DIR / f.name).is_file()
                 or not filecmp.cmp(f, PROTO_DIR / f.name, shallow=False)]
    if stale:
        print(f"out of date: {', '.join(stale)}; run python scripts/gen_protos.py", file=sys.stderr)
        return 1
    print("app/grpc/proto modules are up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
