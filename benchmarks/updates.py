"""Benchmark: weight updates at a real model's shape, with a streaming client running.

For ``--model DIR`` (a ``tito make-tiny-model --shape`` model: random bf16 weights), each round starts each system
fresh, one after the other (the order alternates), with ``--streams`` clients streaming ``/v1/completions`` the whole
time, and runs:

- tito: ``--repeat`` full updates from disk (``POST /update_weights`` of the served checkpoint itself, a new
  ``weight_version`` each time), then ``--repeat`` + 1 staged sparse deltas (``/stage`` by path, then ``/commit``; the
  first, which fills the workers' copy of the weights, is left out of the figures), then ``--repeat`` broadcasts of the
  same weights over gloo from a trainer process (Prime-RL's wire format, ``/init_broadcaster`` + ``/update_weights``);
- vLLM's own server (``VLLM_SERVER_DEV_MODE=1``): ``--repeat`` reloads of the same files
  (``/collective_rpc`` ``reload_weights`` with ``weights_path``), the anchor.

Every update runs as a trainer runs it: ``POST /pause?mode=keep&clear_cache=false``, the update, ``POST /resume``;
one untimed warm-up update per system first. Per update: seconds of the update call, GB/s (checkpoint bytes over
those seconds), the pause from the client (pause sent to resume answered), the pause a streaming client saw (its
longest gap between two events across the update), and the peak memory of the server's process tree (API, EngineCore,
workers) above its steady state (median of the 2 s before the pause), sampled every 0.1 s: RSS, and its anonymous
part (RSS less mapped files: copies, not the page cache of an mmapped checkpoint). Before each system's updates the
files are read cold (``posix_fadvise(DONTNEED)`` first) and warm: the machine's file read speed; the updates then
read a warm page cache.

``--soak N``: tito only, N full updates under the streams, memory after each (1.5 s after resume), and the slope.

``--modes``: each system at its defaults (``default``: both compile with torch.compile) and eager
(``eager``: ``--enforce-eager``), each a fresh server of its own in the same round; ratios are taken within a round
and a mode. ``--profile``: py-spy samples each server's engine process during its timed updates (collapsed stacks
under the work directory) and the report gives the update's time by the frames it went to.

    python -m benchmarks updates --model models/qwen3-0.6b --rounds 2 --repeat 5      # make bench-updates
    python -m benchmarks updates --model models/qwen3-0.6b --soak 20
    python -m benchmarks updates --model models/qwen3-4b --systems tito --kinds full
    python -m benchmarks updates --report a.json b.json                               # one table from several runs
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.clients import Streams
from benchmarks.probes import Sampler, Spy, engine_pid, read_speed, tree_cpu_s
from benchmarks.report import slope
from benchmarks.servers import ROOT, module_cmd, port_in, reverse_odd, server_cmd, start
from benchmarks.updates_report import report

PAUSE = {"mode": "keep", "clear_cache": "false"}  # Prime-RL's pause


def checkpoint_files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


# ------------------------------------------------------------------------------------------ the systems


class Server:
    """One system, started fresh, with its streams and memory sampler; ``update()`` runs one timed update."""

    def __init__(self, system: str, model: Path, work: Path, streams: int, max_len: int, mode: str = "eager",
                 tito_args: str = "") -> None:
        from tests.helpers import EAGER_ENV, engine_env

        self.system, self.model, self.work, self.mode = system, model, work, mode
        port = port_in()
        extra = f"--max-model-len {max_len}" + (" --enforce-eager" if mode == "eager" else "")
        if system == "tito":
            extra += f" --allowed-weight-root {work} --allowed-weight-root {model} {tito_args}"
        # At its defaults tito compiles, as vLLM's server does: the suite's eager default for tito is lifted.
        env = engine_env({"VLLM_SERVER_DEV_MODE": "1" if system == "vllm" else None,
                          EAGER_ENV: "1" if mode == "eager" else None})
        t0 = time.monotonic()
        self.proc = start(server_cmd(system, str(model), port, True, extra), port,
                          work / f"{system}-{mode}-{port}.log", env)
        self.start_s = time.monotonic() - t0
        try:
            self.pid = self.proc.proc.pid
            self.client = httpx.Client(base_url=self.proc.url, timeout=900)
            self.mem = Sampler(self.pid)
            self.streams = Streams(self.proc.url, streams, max_len - 32).__enter__()
        except BaseException:
            self.proc.kill()  # interrupted while the streams start (a timeout's SIGTERM): no server is left behind
            raise
        self.n = 0

    def close(self) -> None:
        self.streams.__exit__()
        self.mem.close()
        self.client.close()
        self.proc.kill()  # the whole process group: no EngineCore is left behind

    def post(self, path: str, **kw: Any) -> dict[str, Any]:
        r = self.client.post(path, **kw)
        if r.status_code != 200:
            raise RuntimeError(f"{self.system} {path}: {r.status_code} {r.text[:500]}")
        return r.json() if r.content else {}

    def update(self, kind: str, call: Any, nbytes: int) -> dict[str, Any]:
        """pause (keep) -> ``call()`` -> resume, measured."""
        time.sleep(2.0)  # a steady state to measure against
        t0 = time.monotonic()
        steady = self.mem.steady(t0)
        tpot = self.streams.interval(t0)
        self.post("/pause", params=PAUSE)
        t1, cpu1 = time.monotonic(), tree_cpu_s(self.pid)
        try:
            answer = call()
        finally:
            t2, cpu2 = time.monotonic(), tree_cpu_s(self.pid)
            self.post("/resume")
        t3 = time.monotonic()
        self.streams.after(t3)
        time.sleep(1.5)
        peak = self.mem.peak(t0, time.monotonic())
        after = self.mem.steady(time.monotonic())
        answer = answer or {}
        nbytes = int(answer.get("bytes") or nbytes)
        row: dict[str, Any] = {
            "system": self.system, "mode": self.mode, "kind": kind, "update_s": t2 - t1, "pause_s": t3 - t0,
            "gap_s": self.streams.gap(t0, t3), "token_s": tpot, "cpu_s": cpu2 - cpu1, "bytes": nbytes,
            "gbps": nbytes / (t2 - t1) / 1e9,
            "server_s": answer.get("seconds"), "reload_s": answer.get("reload_seconds"),
            "retie_s": answer.get("retie_seconds"), "workers": answer.get("workers"),
            "steady_rss": steady[0], "steady_anon": steady[1],
            "peak_rss_above": peak[0] - steady[0], "peak_anon_above": peak[1] - steady[1],
            "after_rss_above": after[0] - steady[0], "after_anon_above": after[1] - steady[1]}
        print(f"{self.system} ({self.mode}) {kind}: update {row['update_s']:.2f}s ({row['gbps']:.2f} GB/s), "
              f"pause {row['pause_s']:.2f}s, stream gap {row['gap_s']:.2f}s (token {tpot * 1000:.0f} ms), "
              f"peak +{row['peak_rss_above'] / 1e9:.2f} GB RSS (+{row['peak_anon_above'] / 1e9:.2f} anon), "
              f"after +{row['after_rss_above'] / 1e9:.2f} GB",
              file=sys.stderr, flush=True)
        return row

    def full(self, kind: str = "full") -> dict[str, Any]:
        self.n += 1
        size = sum(f.stat().st_size for f in checkpoint_files(self.model))
        if self.system == "vllm":
            return self.update(kind, lambda: self.post("/collective_rpc", json={
                "method": "reload_weights", "kwargs": {"weights_path": str(self.model)}}), size)
        return self.update(kind, lambda: self.post("/update_weights", json={
            "weight_dir": str(self.model), "weight_version": f"full-{self.n}"}), size)


def wait_ready(s: Server, version: str, t0: float, wait: float) -> float | None:
    """Seconds from the stage to every worker holding ``version`` ready (``/weight_status``), waiting at most ``wait``
    seconds after the stage answered not ready (a trainer whose step outlasts the preparation); None: not ready."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        workers = s.client.get("/weight_status").json().get("workers") or []
        pend = [w.get("pending") or {} for w in workers]
        if pend and all(p.get("version") == version and p.get("state") == "ready" for p in pend):
            return time.monotonic() - t0
        if any(p.get("state") == "error" for p in pend):
            return None
        time.sleep(0.5)
    return None


def tito_deltas(s: Server, steps: list[Path], base: str, stage_wait: float = 0.0) -> list[dict[str, Any]]:
    """Stage (by path, while generating) and commit each delta of the chain; the first is marked, not timed.
    ``stage_wait``: how long to wait for the workers to have a stage ready before its commit (0: commit at once)."""
    rows = []
    for k, d in enumerate(steps):
        version = f"delta-{s.n}-{k}"
        time.sleep(3.0)  # a rate to compare with
        t0 = time.monotonic()
        staged = s.post("/stage", data={"version": version, "mode": "delta", "base_version": base, "path": str(d)})
        t1 = time.monotonic()
        ready_s = (t1 - t0) if staged.get("ready") else wait_ready(s, version, t0, stage_wait)
        # Generation while the stage is checked and made ready, against the 3 s before (tokens the streams got).
        rate = s.streams.rate(t0, t1) / max(s.streams.rate(t0 - 3.0, t0), 1e-9)
        row = s.update("delta", lambda v=version: s.post("/commit", data={"version": v, "mode": "delta"}),
                       (d / "delta.stream").stat().st_size)
        row.update(first=k == 0, stage_s=t1 - t0, ready=staged.get("ready"), staging_rate=rate, ready_s=ready_s)
        rows.append(row)
        base = version
    s.n += 1
    return rows


def tito_broadcasts(s: Server, repeat: int) -> list[dict[str, Any]]:
    """A trainer process (this script's ``--sender``) broadcasts the model's own tensors ``repeat`` + 1 times."""
    from tests.helpers import engine_env, free_port

    port = free_port()
    steps = [s.work / "bcast" / f"b{s.n}-{i}" for i in range(repeat + 1)]
    for d in steps:
        d.mkdir(parents=True, exist_ok=True)
        (d / "NCCL_READY").unlink(missing_ok=True)
    cmd = module_cmd("benchmarks.updates", "--sender", str(port), "--model", str(s.model),
                     *[x for d in steps for x in ("--step-dir", str(d))])
    log = (s.work / f"sender-{port}.log").open("wb")
    sender = subprocess.Popen(cmd, cwd=str(ROOT), env=engine_env(), stdout=log, stderr=subprocess.STDOUT,
                              process_group=0)
    rows = []
    try:
        s.post("/init_broadcaster", json={"host": "127.0.0.1", "port": port, "rank_offset": 0,
                                          "inference_world_size": 1, "timeout": 600, "backend": "gloo"})
        for i, d in enumerate(steps):
            def call(d: Path = d, i: int = i) -> dict[str, Any]:
                (d / "NCCL_READY").touch()  # the orchestrator's signal to the trainer
                return s.post("/update_weights", json={"weight_dir": str(d), "weight_version": f"bcast-{s.n}-{i}"})

            c0 = tree_cpu_s(sender.pid)
            row = s.update("broadcast", call, 0)
            row.update(first=i == 0, sender_cpu_s=tree_cpu_s(sender.pid) - c0)  # the trainer shares the cores
            rows.append(row)
        sender.wait(120)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(10)
        log.close()
    s.n += 1
    return rows


def run_sender(port: int, model: Path, step_dirs: list[Path]) -> int:
    """The trainer's side of the broadcast: rank 0 of 2, the model's tensors in Prime-RL's order, once per step dir
    when its NCCL_READY appears (tests/weight_sender.py's wire)."""
    from datetime import timedelta

    from safetensors.torch import load_file
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    from tests.weight_sender import send_state_dicts, state_dicts, wait_ready

    sd = {}
    for f in checkpoint_files(model):
        sd.update(load_file(str(f)))
    dicts = state_dicts(sd)
    pg: Any = stateless_init_torch_distributed_process_group("127.0.0.1", port, 0, 2, "gloo",
                                                             timeout=timedelta(seconds=600))
    for d in step_dirs:
        wait_ready(d, 900)
        send_state_dicts(pg, dicts)
        print(f"sender: sent {d.name}", flush=True)
    return 0


def delta_chain(model: Path, work: Path, n: int, fraction: float) -> list[Path]:
    """``n`` chained sparse deltas (delta.stream) from the model's weights, each moving ``fraction`` of every tensor's
    elements; written once per work directory (a ``done`` marker per step, under a file lock: two runs may share the
    directory), one tensor at a time (a 4B model's chain without two copies of it in memory)."""
    import fcntl
    import zlib

    steps = [work / "chain" / f"step_{k}" for k in range(1, n + 1)]
    with (work / "chain.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all((d / "done").exists() for d in steps):
            return steps
        import torch
        from safetensors import safe_open

        from tests.delta_encoder import StreamWriter, perturb_tensor, stream_order, tensor_delta

        where = {}
        for f in checkpoint_files(model):
            with safe_open(str(f), framework="pt") as st:
                where.update({name: f for name in st.keys()})
        writers = [StreamWriter(d / "delta.stream") for d in steps]
        try:
            for name in sorted(where, key=stream_order):
                with safe_open(str(where[name]), framework="pt") as st:
                    t = st.get_tensor(name)
                for k, w in enumerate(writers, start=1):
                    gen = torch.Generator().manual_seed(1000 * k + zlib.crc32(name.encode()))
                    target = perturb_tensor(t, fraction, gen, scale=0.01)
                    idx, vals = tensor_delta(t, target)
                    if idx.numel():
                        w.add(name, list(t.shape), idx, vals)
                    t = target
        finally:
            for w in writers:
                w.close()
        for k, d in enumerate(steps, start=1):
            (d / "done").touch()
            print(f"delta {k}: {(d / 'delta.stream').stat().st_size / 1e6:.0f} MB", file=sys.stderr, flush=True)
    return steps


# ------------------------------------------------------------------------------------------ runs and the report


def run_system(system: str, mode: str, a: argparse.Namespace, steps: list[Path]) -> dict[str, Any]:
    import contextlib

    import psutil

    files = checkpoint_files(a.model)
    # The weights, the engine's own memory and the KV cache: other engineers' engines share this machine.
    need = 1.3 * sum(f.stat().st_size for f in files) + 3e9
    deadline = time.monotonic() + 90  # the previous system's processes may still be releasing theirs
    while (free := psutil.virtual_memory().available) < need and time.monotonic() < deadline:
        time.sleep(2)
    if free < need:
        print(f"{system}: skipped, {free / 1e9:.1f} GB available < {need / 1e9:.1f} GB", file=sys.stderr, flush=True)
        return {"skipped": f"{free / 1e9:.1f} GB available, {need / 1e9:.1f} GB needed", "rows": []}
    reads = read_speed(files)
    print(f"{system} ({mode}): read {reads}", file=sys.stderr, flush=True)
    s = Server(system, a.model, a.work, a.streams, a.max_model_len, mode, a.tito_args)
    out: dict[str, Any] = {"start_s": s.start_s, "read": reads, "rows": []}
    try:
        s.full("warm-up")  # the first update of a server pays one-time costs
        stacks = a.work / f"stacks-{system}-{mode}-{time.strftime('%H%M%S')}.txt"
        with Spy(engine_pid(s.pid), stacks) if a.profile else contextlib.nullcontext():
            if system == "vllm" or "full" in a.kinds:
                out["rows"] += [s.full() for _ in range(a.repeat)]
            if system == "tito" and "delta" in a.kinds:
                out["rows"] += tito_deltas(s, steps, f"full-{s.n}", a.stage_wait)
            if system == "tito" and "broadcast" in a.kinds:
                out["rows"] += tito_broadcasts(s, a.repeat)
        if a.profile:
            out["profile"] = str(stacks)
        out["stream_errors"] = s.streams.errors
    finally:
        s.close()
    return out


def soak(a: argparse.Namespace) -> dict[str, Any]:
    s = Server("tito", a.model, a.work, a.streams, a.max_model_len, a.modes.split(",")[0], a.tito_args)
    try:
        s.full("warm-up")
        rows = [s.full("soak") for _ in range(a.soak)]
        errors = s.streams.errors
    finally:
        s.close()
    after = [r["steady_rss"] + r["after_rss_above"] for r in rows]
    anon = [r["steady_anon"] + r["after_anon_above"] for r in rows]
    return {"rows": rows, "after_rss": after, "after_anon": anon, "slope_rss": slope(after),
            "slope_anon": slope(anon), "stream_errors": errors, "start_s": s.start_s}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks updates", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="A model directory (absolute path; tito make-tiny-model --shape).")
    p.add_argument("--work", type=Path, default=None, help="Logs, delta chain, broadcast markers (default: "
                   "/tmp/tito-bench-updates/<model name>).")
    p.add_argument("--systems", default="tito,vllm")
    p.add_argument("--modes", default="default,eager", help="Engine modes, each a server of its own per system: "
                   "default (each at its defaults: torch.compile) and eager (--enforce-eager).")
    p.add_argument("--tito-args", default="", help="More flags for tito, e.g. --tito-args='--delta-copy file'.")
    p.add_argument("--profile", action="store_true", help="py-spy each server's engine during its timed updates.")
    p.add_argument("--kinds", default="full,delta,broadcast", help="tito's updates: full, delta, broadcast.")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--first-round", type=int, default=0, help="The first round's number (0, 1, ...): odd rounds run "
                   "the modes and systems in reverse order, so separate runs of one round each alternate too.")
    p.add_argument("--repeat", type=int, default=5, help="Timed updates of each kind per round and system.")
    p.add_argument("--streams", type=int, default=2, help="Clients streaming /v1/completions throughout.")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--fraction", type=float, default=0.02, help="Share of elements a delta step changes.")
    p.add_argument("--stage-wait", type=float, default=0.0,
                   help="Seconds to wait for a stage the workers have not made ready when /stage answers, before its "
                        "commit (a trainer whose step outlasts the preparation); 0: commit at once.")
    p.add_argument("--soak", type=int, default=0, help="Instead: N full updates on tito, memory after each.")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--sender", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--step-dir", type=Path, action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--report", type=Path, nargs="+", default=None, help="Instead: the table of these runs' JSON "
                   "files together (their rounds pooled; the soak of the last one that has one).")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.sender is not None:
        return run_sender(a.sender, a.model, a.step_dir)
    if a.report:
        runs = [json.loads(f.read_text()) for f in a.report]
        pooled = {**runs[0], "rounds": [rd for r in runs for rd in r["rounds"]],
                  "soak": next((r["soak"] for r in reversed(runs) if r.get("soak")), None)}
        print(report(pooled))
        return 0
    # A timeout's SIGTERM unwinds through the finally blocks, which kill the servers' process groups.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    a.model = a.model.resolve()
    a.work = (a.work or Path("/tmp/tito-bench-updates") / a.model.name).resolve()
    a.work.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(a.model)
    res: dict[str, Any] = {"model": str(a.model), "checkpoint_bytes": sum(f.stat().st_size for f in files),
                           "largest_file": max(f.stat().st_size for f in files), "streams": a.streams, "rounds": [],
                           "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    out = a.json or a.work / ("soak.json" if a.soak else "updates.json")
    if a.soak:
        res["soak"] = soak(a)
    else:
        systems = [s for s in a.systems.split(",") if s]
        steps = delta_chain(a.model, a.work, a.repeat + 1, a.fraction) if "tito" in systems and \
            "delta" in a.kinds else []
        for i in range(a.first_round, a.first_round + a.rounds):
            rd: dict[str, Any] = {}
            for mode in reverse_odd([m for m in a.modes.split(",") if m], i):
                for system in reverse_odd(systems, i):
                    rd[f"{system}/{mode}"] = run_system(system, mode, a, steps)
                    out.write_text(json.dumps({**res, "rounds": [*res["rounds"], rd]}, indent=1))
            res["rounds"].append(rd)
            out.write_text(json.dumps(res, indent=1))
    res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    res["table"] = report(res)
    out.write_text(json.dumps(res, indent=1))
    print(res["table"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
