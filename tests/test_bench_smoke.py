"""The serving benchmark (``python -m benchmarks serving``) runs end to end on a tiny workload (a smoke test: it checks
the harness, not the numbers), and the benchmarks' shared pieces (benchmarks/) do what they say."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from benchmarks import clients as loadgen
from benchmarks import probes, servers, serving_vllm
from benchmarks import serving as bench
from tests.helpers import ROOT, ServerProcess, engine_env


@pytest.mark.engine
def test_bench_quick_run_writes_table_json_and_chart(tiny_model: Path, tito: ServerProcess, tmp_path: Path) -> None:
    """The tito system is the session's shared default server (the tiny model at its own 512-token context, as
    the benchmark starts it): one engine start fewer than the benchmark starting its own (the in-process systems start
    theirs)."""
    assert tito.proc is not None
    out_dir = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "serving", "--quick", "--rounds", "1", "--systems",
         "matched,inprocess,tito", "--workloads", "64x64,stream64x64,1x1,mixed", "--model", str(tiny_model),
         "--out", str(out_dir), "--tito-url", tito.url, "--tito-pid", str(tito.proc.pid)],
        capture_output=True, text=True, cwd=ROOT, env=engine_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for wl in ("64x64", "stream64x64", "1x1", "mixed"):
        assert any(line.startswith(f"{wl} ") and " tito " in f" {line} " for line in proc.stdout.splitlines()), wl
    assert "tito/inprocess" in proc.stdout and "tito/matched" in proc.stdout

    doc = json.loads((out_dir / "bench.json").read_text())
    assert doc["meta"]["tito_url"] == tito.url and "start_s" not in doc["rounds"][0]["tito"]
    summary = doc["summary"]
    for wl in ("64x64", "stream64x64", "1x1", "mixed"):
        for system in ("inprocess", "tito"):
            m = summary["workloads"][wl][system]
            assert m["errors"] == 0 and m["req_s"] > 0 and m["p50_ms"] > 0, (wl, system, m)
            # Read from clock ticks (10 ms): a quick workload may take less than one, so only >= 0 is certain.
            assert m["cpu_ms_per_req"] is not None and m["cpu_ms_per_req"] >= 0, (wl, system, m)
        # The HTTP load generator reports its own CPU (the in-process system has none).
        assert summary["workloads"][wl]["tito"]["client_cpu_ms_per_req"] > 0
        assert summary["workloads"][wl]["inprocess"]["client_cpu_ms_per_req"] is None
        assert summary["workloads"][wl]["tito/inprocess"] is not None or wl == "1x1"
    # Every request of the quick 64x64 workload (4 clients x 2 requests x 8 tokens) was counted.
    assert doc["rounds"][0]["tito"]["64x64"]["tokens"] == 4 * 2 * 8
    assert doc["rounds"][0]["tito"]["stream64x64"]["tokens"] == 4 * 2 * 8
    assert summary["cold_errors"] == {"inprocess": 0, "tito": 0, "matched": 0}
    # The matched run burned, per workload, what tito's HTTP layer and client added over the in-process system.
    r0 = doc["rounds"][0]
    for wl in ("64x64", "stream64x64", "1x1", "mixed"):
        want = bench.extra_cores(r0["tito"][wl], r0["inprocess"][wl])
        assert r0["matched"][wl]["burned_cores"] == pytest.approx(want) and r0["matched"][wl]["errors"] == 0
    memory = summary["memory"]
    assert memory["tito_own_mb"] == memory["tito"]["server_uss_mb"] - memory["inprocess"]["server_uss_mb"]
    mem = summary["memory"]["tito"]
    assert mem["server_rss_mb"] > 50 and mem["engine_rss_mb"] > 50 and 0 < mem["server_uss_mb"] < mem["server_rss_mb"]
    png = out_dir / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_raw_load_generator_counts_every_failure_and_keeps_going() -> None:
    """The lean load generator against a scripted HTTP server: a good answer, a 500, a short answer, a connection
    dropped before the answer, an answer that closes the connection, and a good one again. Every failure is counted
    (none is fatal, none hangs) and the client reconnects after a drop."""
    good = orjson.dumps({"choices": [{"token_ids": [7, 8]}]})
    short = orjson.dumps({"choices": [{"token_ids": [7]}]})
    script = [
        (b"200 OK", good, b""),
        (b"500 Internal Server Error", b'{"error": "boom"}', b""),
        (b"200 OK", short, b""),
        None,  # drop the connection without answering
        (b"200 OK", good, b"Connection: close\r\n"),
        (b"200 OK", good, b""),
    ]
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
            seen.append(await reader.readexactly(length))
            step = script[len(seen) - 1]
            if step is None:
                break
            status, body, extra = step
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n" + extra
                         + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            if extra:
                break
        writer.close()

    async def run() -> dict[str, Any]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            wl = loadgen.Workload("scripted", 1, 2, False, len(script), "req/s")
            return await asyncio.wait_for(loadgen.raw_load(f"http://127.0.0.1:{port}", wl), 30)

    res = asyncio.run(run())
    assert len(seen) == len(script)  # every request reached the server, in order, over reconnects
    assert all(orjson.loads(b)["sampling_params"]["max_tokens"] == 2 for b in seen)
    assert (res["ok"], res["errors"], res["tokens"]) == (3, 3, 6), res
    text = " | ".join(res["error_samples"])
    assert "HTTP 500" in text and "short answer: 1 of 2" in text and "closed the connection" in text, text


def test_stream_answers_are_checked_event_by_event() -> None:
    ok = b'data: {"choices":[{"token_ids":[1,2]}]}\n\ndata: {"choices":[{"token_ids":[3]}]}\n\ndata: [DONE]\n\n'
    assert loadgen._count_tokens(ok, True) == 3
    with pytest.raises(RuntimeError, match="without \\[DONE\\]"):
        loadgen._count_tokens(ok.replace(b"data: [DONE]\n\n", b""), True)
    with pytest.raises(RuntimeError, match="error event"):
        loadgen._count_tokens(b'data: {"error":{"message":"x"}}\n\ndata: [DONE]\n\n', True)


def test_burner_keeps_the_asked_share_of_a_core_busy() -> None:
    """The matched baseline is only as good as its burner: half a core asked, about half a core used (measured from
    the ``with`` block's start: the burner is past its interpreter's start-up by then)."""
    import psutil

    with bench.Burner(0.5) as burner:
        assert len(burner.procs) == 1
        proc = psutil.Process(burner.procs[0].pid)
        c0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        time.sleep(2.0)  # the window the burner's CPU share is measured over (the sleep is what is measured)
        used = (sum(proc.cpu_times()[:2]) - c0) / (time.monotonic() - t0)
    assert 0.25 < used < 0.75, used
    assert all(p.poll() is not None for p in burner.procs)  # stopped with the block
    with bench.Burner(1.5) as two:  # more than a core: one full-time burner and one at half time
        assert len(two.procs) == 2
    assert all(p.poll() is not None for p in two.procs)


def test_token_route_cases_keep_vllm_bench_shape_and_vllm_serves_them_tokens_only() -> None:
    """vLLM's benchmark client has no backend for /inference/v1/generate: the token-route cases send the same shape
    (32-token prompts) from the load generator, and vLLM's server answers them as its dedicated token server."""
    case = serving_vllm.CASES["t16"]
    wl = loadgen.Workload(case.name, case.concurrency, case.output_len, case.stream, 2, "tok/s", case.input_len)
    assert [len(loadgen.request_spec(wl, i)[0]) for i in range(2)] == [32, 32]
    assert len(loadgen.request_spec(loadgen.Workload("64x64", 64, 64, False, 1, "tok/s"), 0)[0]) == 16
    vllm = servers.server_cmd("vllm", "m", 1, True, "--enforce-eager", tokens_only=True)
    assert "--tokens-only" in vllm and vllm[-1] == "--enforce-eager"
    assert "--tokens-only" not in servers.server_cmd("tito", "m", 1, True, "", tokens_only=True)
    with pytest.raises(SystemExit, match="separate runs"):
        serving_vllm.main(type("NS", (), {"cases": "c16,t16"})(), "m")


def test_probes_count_the_engine_processes_cpu() -> None:
    """The engine's CPU is that of every process below tito's: a grandchild counts too, a process gone counts 0."""
    nap = "import time; time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, "
                              f"'-c', {nap!r}]); {nap}"])
    try:
        deadline = time.monotonic() + 20
        while not probes.descendants(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = probes.descendants(child.pid)
        assert len(grandchild) == 1
        assert {child.pid, *grandchild} <= set(probes.descendants(os.getpid()))
        assert probes.cpu_seconds([child.pid, *grandchild]) >= 0.0
        assert probes.cpu_seconds([2**22 + 1]) == 0.0
    finally:
        for pid in probes.descendants(child.pid):
            os.kill(pid, signal.SIGKILL)
        child.kill()
        child.wait(10)


def test_one_entry_point_runs_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m benchmarks`` lists every benchmark; each one's module imports and its flags parse (the commands the
    docs show are checked against these parsers in tests/test_docs.py); an unknown name is an error."""
    from benchmarks.__main__ import COMMANDS, main, parser

    assert main([]) == 2
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in COMMANDS) and len(COMMANDS) >= 10
    for name in COMMANDS:
        assert parser(name).prog == f"python -m benchmarks {name}"
    assert parser("updates").parse_args(["--model", "m", "--kinds", "full"]).kinds == "full"
    assert main(["no-such-benchmark"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ended:
        main(["updates", "--no-such-flag"])
    assert ended.value.code == 2
