"""Data parallel: ``--data-parallel-size 2`` runs two EngineCores behind one server (the shared ``api2``: Prime-RL's
launcher's command line for dp = 2, so two API processes too, tests/conftest.py); ``X-data-parallel-rank`` pins a
request to one of them (checked in each engine's own ``vllm:request_success_total``); a bad rank is a 400. Over
gRPC, ``vllm.Control`` describes both cores (what Dynamo's sidecar reads: a KV-event source per rank, the world size
per data-parallel engine) and ``x-data-parallel-rank`` metadata pins ``vllm.Inference`` requests the same way."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.helpers import ServerProcess, metric_value
from tests.sweep import fire, shapes

pytestmark = pytest.mark.engine

GEN = "/inference/v1/generate"
BODY = {"token_ids": [3, 1, 4, 1, 5], "sampling_params": {"max_tokens": 6, "temperature": 0}}


@pytest.fixture(scope="module")
def server(api2: ServerProcess) -> ServerProcess:
    return api2


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
    """The trainer request-shape sweep on data parallel 2: every shape unpinned, and again pinned to rank 0 or 1."""
    bodies = shapes()
    pinned = {f"{name}@{i % 2}": body for i, (name, body) in enumerate(bodies.items())}
    fire(server.url, {**bodies, **pinned}, headers={name: {"X-data-parallel-rank": name[-1]} for name in pinned})


def test_vllm_grpc_services_see_both_cores(server: ServerProcess, client: httpx.Client) -> None:
    from app.grpc.proto import vllm_control_pb2 as cpb
    from tests.sidecar import control, gen, inference, joined

    info = client.get("/server_info").json()
    si = control(server).GetServerInfo(cpb.GetServerInfoRequest())
    p = si.parallelism
    assert (p.data_parallel_size, p.data_parallel_rank, p.data_parallel_size_local) == (2, 0, 2)
    # Per data-parallel engine; the sidecar multiplies by the DP size for /v1/rl/workers: tito's world size.
    assert p.world_size == 1 and p.world_size * p.data_parallel_size == info["parallelism"]["world_size"] == 2
    assert si.total_kv_blocks == 2 * info["model"]["num_kv_blocks"]  # over both cores
    sources = control(server).GetKvEventSources(cpb.GetKvEventSourcesRequest()).sources
    assert sorted(s.data_parallel_rank for s in sources) == [0, 1]
    assert {s.endpoint for s in sources} == set(info["features"]["kv_events"].values())
    for rank in (0, 1):
        before = _finished(client, str(rank)), _finished(client, str(1 - rank))
        got = joined(inference(server).GenerateStream(gen([3, 1, 4, 1, 5], 6, model=""),
                                                      metadata=(("x-data-parallel-rank", str(rank)),)))
        assert len(got["tokens"]) == 6
        assert (_finished(client, str(rank)), _finished(client, str(1 - rank))) == (before[0] + 1, before[1])
