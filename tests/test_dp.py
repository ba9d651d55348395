"""Data parallel: ``--data-parallel-size 2`` runs two EngineCores behind one server; ``X-data-parallel-rank`` pins a
request to one of them (checked in each engine's own ``vllm:request_success_total``); a bad rank is a 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import start_tito
from tests.helpers import ServerProcess, metric_value
from tests.sweep import fire, shapes

GEN = "/inference/v1/generate"
BODY = {"token_ids": [3, 1, 4, 1, 5], "sampling_params": {"max_tokens": 6, "temperature": 0}}


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = start_tito(tmp_path_factory, tiny_model, "--data-parallel-size", "2", name="dp2")
    yield s
    s.kill()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _finished(c: httpx.Client, engine: str) -> float:
    return metric_value(c.get("/metrics").text, "vllm:request_success_total", {"engine": engine}) or 0.0


def test_two_engine_cores_behind_one_server(server: ServerProcess, client: httpx.Client) -> None:
    assert server.proc is not None
    cores = [p for p in psutil.Process(server.proc.pid).children(recursive=True) if "EngineCore" in p.name()]
    assert len(cores) == 2
    par = client.get("/server_info").json()["parallelism"]
    assert par["data_parallel_size"] == 2
    assert (par["data_parallel_rank_start"], par["data_parallel_rank_end"]) == (0, 2)
    lv = client.get("/liveness")  # the round trip reaches both cores
    assert lv.status_code == 200 and lv.json()["status"] == "ok"


def test_rank_header_pins_requests(client: httpx.Client) -> None:
    outputs = []
    for rank in (0, 1):
        other = str(1 - rank)
        before, before_other = _finished(client, str(rank)), _finished(client, other)
        for _ in range(3):
            r = client.post(GEN, json=BODY, headers={"X-data-parallel-rank": str(rank)})
            assert r.status_code == 200, r.text
            outputs.append(r.json()["choices"][0]["token_ids"])
        r = client.post(GEN, json={**BODY, "stream": True}, headers={"X-data-parallel-rank": str(rank)})
        assert r.status_code == 200 and "error" not in r.text
        assert _finished(client, str(rank)) - before == 4
        assert _finished(client, other) == before_other
    # Same weights on both cores: greedy answers agree, and agree with an unpinned request.
    unpinned = client.post(GEN, json=BODY).json()["choices"][0]["token_ids"]
    assert all(o == unpinned for o in outputs) and len(unpinned) == 6


@pytest.mark.parametrize("bad", ["2", "-1", "abc", "1.0", "", "99999999999999999999"])
def test_bad_rank_is_400(client: httpx.Client, bad: str) -> None:
    r = client.post(GEN, json=BODY, headers={"X-data-parallel-rank": bad})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["param"] == "X-data-parallel-rank"
    assert "X-data-parallel-rank" in err["message"]


def test_trainer_request_shapes_together_keep_both_engines(server: ServerProcess) -> None:
    """Issue 31's sweep on data parallel 2: every shape unpinned, and again pinned to rank 0 or 1."""
    bodies = shapes()
    pinned = {f"{name}@{i % 2}": body for i, (name, body) in enumerate(bodies.items())}
    fire(server.url, {**bodies, **pinned}, headers={name: {"X-data-parallel-rank": name[-1]} for name in pinned})
