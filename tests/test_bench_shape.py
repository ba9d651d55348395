"""``make bench SHAPE=...`` (Makefile): the model of the shape asked for, written by tito's model maker at
models/<shape>, is the one the benchmark serves; an unknown shape stops make before anything runs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _make_n(*args: str) -> subprocess.CompletedProcess[str]:
    # -B: every rule out of date, so the model's rule is printed whether or not the model was written here already
    return subprocess.run(["make", "-n", "-B", "-C", str(ROOT), "bench", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"])
def test_bench_shape_makes_and_serves_that_shape(shape: str) -> None:
    out = _make_n(f"SHAPE={shape}")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.replace("\\\n", " ").splitlines()
    make_model = [x for x in lines if "make-tiny-model" in x]
    assert make_model and make_model[0].split()[-3:] == [f"models/{shape}", "--shape", shape], make_model
    bench = [x.split() for x in lines if "-m benchmarks serving" in x]
    assert len(bench) == 1 and bench[0][bench[0].index("--model") + 1] == f"models/{shape}"
    assert {"--vllm-bench", "--defaults", "--update"} <= set(bench[0])
    assert not [x for x in lines if "benchmarks weights" in x]  # the tiny model's weight benchmark is not run


def test_bench_unknown_shape_stops_make() -> None:
    out = _make_n("SHAPE=qwen3-70b")
    assert out.returncode != 0 and "SHAPE=qwen3-70b: one of qwen3-0.6b" in out.stderr
    assert "benchmarks serving" not in out.stdout
