"""The floor of a token stream's transport: CPU per message of a ``grpc.aio`` server stream, of the same servicer on
pygrpc-native's server (tito's default ``--grpc-server native``), and of a bare asyncio (uvloop) socket that writes
one SSE-like frame per message, no engine and no tito code.

    python -m benchmarks transport [--streams 32] [--messages 64] [--step 0.004] [--rounds 3]

Each server runs in a process of its own; ``--streams`` concurrent streams of ``--messages`` small messages each, a
message every ``--step`` seconds per stream (an engine step), rounds alternating. The server process's CPU (from
/proc) per message says what one message per token costs whatever the servicer does: the part of tito's gRPC path
that fewer messages, not leaner code, would remove.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import uvloop

from benchmarks.probes import process_cpu_s as cpu_seconds
from benchmarks.servers import port_in as free_port


def _ticking(step: float) -> asyncio.Event:
    """An event set once per ``step`` (every stream waits for it between messages, as for an engine step)."""
    tick = asyncio.Event()

    async def run() -> None:
        while True:
            await asyncio.sleep(step)
            tick.set()
            tick.clear()

    asyncio.get_running_loop().create_task(run())
    return tick


def native_server(port: int, messages: int, step: float, ready: Any) -> None:
    grpc_server(port, messages, step, ready, native=True)


def grpc_server(port: int, messages: int, step: float, ready: Any, native: bool = False) -> None:
    import grpc

    from app.grpc.proto import vllm_inference_pb2 as pb
    from app.grpc.proto import vllm_inference_pb2_grpc as pb_grpc

    async def main() -> None:
        tick = _ticking(step)

        class Servicer(pb_grpc.InferenceServicer):
            async def GenerateStream(self, request: Any, context: Any) -> None:  # noqa: N802
                for i in range(messages):
                    await tick.wait()
                    msg = pb.GenerateResponse()
                    msg.outputs.num_tokens = 1
                    msg.outputs.token_ids.append(i)
                    msg.outputs.text = "ab"
                    await context.write(msg)

        if native:
            import pygrpc_native.aio
            server = pygrpc_native.aio.server()
        else:
            server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(Servicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    uvloop.run(main())


def raw_server(port: int, messages: int, step: float, ready: Any) -> None:
    async def main() -> None:
        tick = _ticking(step)

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.readline()
            for i in range(messages):
                await tick.wait()
                w.write(b'data: {"token_ids":[%d],"text":"ab"}\n\n' % i)
                await w.drain()
            w.close()

        server = await asyncio.start_server(handle, "127.0.0.1", port)
        ready.set()
        await server.serve_forever()

    uvloop.run(main())


async def grpc_client(port: int, streams: int, requests: int) -> None:
    import grpc

    from app.grpc.proto import vllm_inference_pb2 as pb
    from app.grpc.proto import vllm_inference_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.InferenceStub(ch)

        async def one(k: int) -> None:
            for _ in range(k):
                async for _m in stub.GenerateStream(pb.GenerateRequest()):
                    pass

        await asyncio.gather(*(one(requests // streams) for _ in range(streams)))


async def raw_client(port: int, streams: int, requests: int) -> None:
    async def one(k: int) -> None:
        for _ in range(k):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"go\n")
            while await r.read(65536):
                pass
            w.close()

    await asyncio.gather(*(one(requests // streams) for _ in range(streams)))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks transport", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--messages", type=int, default=64)
    ap.add_argument("--step", type=float, default=0.004)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)

    servers = {"grpc": (grpc_server, grpc_client), "native": (native_server, grpc_client),
               "raw": (raw_server, raw_client)}
    procs: dict[str, tuple[mp.Process, int]] = {}
    per_msg: dict[str, list[float]] = {k: [] for k in servers}
    try:
        for name, (serve, _) in servers.items():
            port, ready = free_port(), mp.Event()
            p = mp.Process(target=serve, args=(port, ns.messages, ns.step, ready), daemon=True)
            p.start()
            if not ready.wait(60):
                raise RuntimeError(f"the {name} server did not start")
            procs[name] = (p, port)
        for _ in range(ns.rounds):
            for name, (_, client) in servers.items():
                p, port = procs[name]
                c0 = cpu_seconds(p.pid or 0)
                t0 = time.perf_counter()
                uvloop.run(client(port, ns.streams, ns.requests))
                per_msg[name].append(1e6 * (cpu_seconds(p.pid or 0) - c0) / (ns.requests * ns.messages))
                print(f"{name}: {per_msg[name][-1]:.1f} us/message ({time.perf_counter() - t0:.1f}s)",
                      file=sys.stderr, flush=True)
    finally:
        for p, _ in procs.values():
            p.kill()
    print(f"\n{ns.streams} streams x {ns.messages} messages, one per {ns.step * 1000:.0f} ms per stream, "
          f"{ns.rounds} alternating rounds, {os.cpu_count()} cores")
    print("| server | server CPU µs per message (min / median / max) |\n|---|---|")
    for name, xs in per_msg.items():
        print(f"| {name} | {min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
