"""Fast tests (no engine) of the pieces behind ``--api-server-count``: the shared board and slots, what the control
process publishes and an API process applies, the HTTP hop between processes over a Unix socket, the port bound and
answering before vLLM is imported, and how many API processes a command line asks for. The real engine's tests:
tests/test_api_servers.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from app.core.protocol import ApiError
from app.core.settings import Settings
from app.engine.vllm_args import api_processes, parse_serve
from app.server import early_bind
from app.server.board import ADMITTED, FINISHED, INFLIGHT, Shared
from app.server.forward import UdsClient, Unreachable, forward
from app.server.mirror import apply_board, board_doc
from app.server.state import PER_PROCESS, SERVER_WIDE, AppState, not_started_app
from tests.fake_engine import FakeEngine
from tests.helpers import free_port

# ------------------------------------------------------------------------------------------------ the board


def test_board_round_trip_and_only_changes_move_it() -> None:
    shared = Shared(2, board_bytes=4096)
    assert shared.read() == (0, {})
    assert shared.write({"ready": True, "loras": [{"name": "a"}]})
    seq, doc = shared.read()
    assert seq == 2 and doc == {"ready": True, "loras": [{"name": "a"}]}
    assert not shared.write({"loras": [{"name": "a"}], "ready": True})  # the same document: no new sequence number
    assert shared.seq == 2
    assert shared.write({"ready": False}) and shared.read() == (4, {"ready": False})
    assert not shared.write({"big": "x" * 5000})  # over the capacity: the last one that fitted stays
    assert shared.read() == (4, {"ready": False})


def test_a_torn_board_is_never_read() -> None:
    """A reader that meets a write in progress (odd number) or a payload that does not match its checksum retries,
    and gives up with an error rather than return a mix."""
    shared = Shared(1, board_bytes=4096)
    shared.write({"ready": True})
    shared.header[0] += 1  # a writer stopped in the middle
    with pytest.raises(RuntimeError, match="stuck mid-write"):
        shared.read()
    shared.header[0] += 1
    shared.mem[shared._payload_at] = ord("[")  # the payload changed under an even number
    with pytest.raises(RuntimeError):
        shared.read()


def test_slots_are_summed_over_every_process() -> None:
    shared = Shared(2)
    for slot, n in ((0, 3), (1, 4), (2, 1)):
        shared.set(slot, INFLIGHT, n)
        shared.add(slot, FINISHED, 10 * n)
    assert shared.total(INFLIGHT) == 8 and shared.total(FINISHED) == 80
    assert shared.row(1)["inflight"] == 4 and shared.row(1)["finished"] == 40
    assert list(shared.loads) == [2**31 - 1] * 2  # no process accepts before it says so


def test_every_appstate_field_is_per_process_or_server_wide() -> None:
    fields = {f.name for f in dataclasses.fields(AppState)}
    assert fields == SERVER_WIDE | PER_PROCESS and not SERVER_WIDE & PER_PROCESS, fields ^ (SERVER_WIDE | PER_PROCESS)


async def test_an_api_process_serves_what_the_control_process_published() -> None:
    """The control process's state as an API process sees it after applying the board: admission, the pause, the LoRA
    registry (handles of its own, built once), inconsistent weights, the prefix-cache salt, the in-flight count."""
    from app.weights.lora import LoraEntry
    from app.weights.updates import Inconsistent

    shared = Shared(1)
    settings = Settings.build(env={})
    control = AppState(settings=settings, engine=FakeEngine.with_lora())
    api = AppState(settings=settings, engine=FakeEngine.with_lora(), api_process=True)
    assert not hasattr(api, "staging")  # staging and AReaL are the control process's alone
    control.ready = True
    control.start_drain()
    control.engine.paused = True
    control.engine.cache_epoch = "tito-weights-3"
    control.weights.version = "step_7"
    control.weights.inconsistent = Inconsistent("load failed", "disk", 1.0, True)
    control.adapters.entries["a"] = LoraEntry("a", 1, "/tmp/a", 5.0, rank=8, reloads=2)
    shared.write(board_doc(control, {"launched": None}))
    apply_board(api, shared.read()[1])
    assert api.ready and api.draining and api.not_ready_reason == "draining"
    assert api.engine.paused and api.engine.cache_epoch == "tito-weights-3" and api.weight_version == "step_7"
    assert api.weights.inconsistent == control.weights.inconsistent
    with pytest.raises(ApiError) as refused:
        api.admit()
    assert refused.value.status == 503
    entry = api.adapters.resolve("a")
    assert (entry.int_id, entry.path, entry.reloads, entry.rank) == (1, "/tmp/a", 2, 8)
    assert entry.handle.lora_name == "a" and entry.handle.lora_int_id == 1 and not entry.handle.load_inplace
    handle = entry.handle
    apply_board(api, shared.read()[1])
    assert api.adapters.resolve("a").handle is handle  # unchanged: not rebuilt
    control.adapters.entries.clear()
    control.stop_drain()
    control.weights.inconsistent = None
    shared.write(board_doc(control, {}))
    apply_board(api, shared.read()[1])
    assert api.not_ready_reason is None and "a" not in api.loras
    with pytest.raises(ApiError):
        api.resolve_model("a")


async def test_requests_in_flight_are_counted_across_processes() -> None:
    class Peers:
        def __init__(self, shared: Shared, slot: int) -> None:
            self.slots, self.slot = shared, slot

        def changed(self, state: AppState) -> None:
            return

    shared = Shared(1)
    settings = Settings.build(env={})
    a = AppState(settings=settings, engine=FakeEngine(), api_process=True)
    b = AppState(settings=settings, engine=FakeEngine())
    a.join(Peers(shared, 0))  # type: ignore[arg-type]
    b.join(Peers(shared, 1))  # type: ignore[arg-type]
    ids = [a.enter("x"), a.enter("y"), b.enter("z")]
    assert a.inflight == b.inflight == 3 and a.local == 2 and b.local == 1
    assert shared.get(0, ADMITTED) == 2
    b.start_drain()
    a.leave(ids[0])
    assert b.finished_since_drain == 1 and b.inflight == 2
    assert not await b.wait_idle(0.05)
    a.leave(ids[1])
    b.leave(ids[2])
    assert await b.wait_idle(1.0) and b.finished_since_drain == 3


# ------------------------------------------------------------------------------------------------ the hop


async def _echo(scope: Scope, receive: Receive, send: Send) -> None:
    """An app that answers with what it got: method, path, query, headers, the body's length; streamed in 3 parts."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = await Request(scope, receive).body()
    seen = {"method": scope["method"], "path": scope["path"], "query": scope["query_string"].decode(),
            "headers": {k.decode(): v.decode() for k, v in scope["headers"]}, "length": len(body),
            "sum": sum(body) % 1000}
    data = json.dumps(seen).encode()
    status = 201 if scope["path"] == "/created" else 200
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json"),
                                                                             (b"x-answer", b"yes")]})
    for part in (data[:5], data[5:10], data[10:]):
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@contextlib.asynccontextmanager
async def _served(tmp_path: Path) -> AsyncIterator[str]:
    path = str(tmp_path / "s.sock")
    server = uvicorn.Server(uvicorn.Config(_echo, uds=path, log_level="warning", lifespan="off"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield path
    finally:
        server.should_exit = True
        await task


async def test_the_internal_call_and_the_forwarded_request_arrive_as_sent(tmp_path: Path) -> None:
    async with _served(tmp_path) as path:
        client = UdsClient(path)
        status, body = await client.call("POST", "/_tito/abort?x=1", {"request_ids": None}, {"x-tito-internal": "s"})
        assert status == 200 and body["path"] == "/_tito/abort" and body["query"] == "x=1"
        assert body["headers"]["x-tito-internal"] == "s" and body["length"] == len(b'{"request_ids": null}')
        status, _ = await client.call("GET", "/again")  # the kept connection serves the next call
        assert status == 200 and len(client._idle) == 1

        # A client's request, forwarded as ASGI sees it: streamed body (chunked), every header, the answer back.
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            await forward(client, scope, receive, send, b"secret 1 10.0.0.9 5555",
                          lambda: ApiError(503, "control process unreachable"))

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tito") as c:
            chunks = [bytes([i % 256]) * 70000 for i in range(3)]

            async def stream() -> AsyncIterator[bytes]:
                for chunk in chunks:
                    yield chunk

            r = await c.post("/created?mode=keep", content=stream(), headers={"authorization": "Bearer k"})
            assert r.status_code == 201 and r.headers["x-answer"] == "yes"
            seen = r.json()
            assert seen["length"] == 210000 and seen["sum"] == sum(b"".join(chunks)) % 1000
            assert seen["query"] == "mode=keep" and seen["headers"]["authorization"] == "Bearer k"
            assert seen["headers"]["x-tito-forwarded"] == "secret 1 10.0.0.9 5555"
            assert seen["headers"]["transfer-encoding"] == "chunked"
            r = await c.head("/health")
            assert r.status_code == 200 and r.content == b""
        client.close()

    # Nobody listening: the caller's answer, and the request was never run.
    with pytest.raises(Unreachable):
        await UdsClient(str(tmp_path / "none.sock")).call("GET", "/")
    gone = UdsClient(str(tmp_path / "none.sock"))

    async def app2(scope: Scope, receive: Receive, send: Send) -> None:
        await forward(gone, scope, receive, send, b"s 0 - 0", lambda: ApiError(503, "server is starting"))

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app2), base_url="http://tito") as c:
        r = await c.post("/pause")
        assert r.status_code == 503 and r.json()["error"]["message"] == "server is starting"


# ------------------------------------------------------------------------------------------------ the port first


@pytest.mark.parametrize(("argv", "env", "where"), [
    ([], {}, ("127.0.0.1", 8000)),
    (["m", "--port", "9001", "--host=0.0.0.0"], {}, ("0.0.0.0", 9001)),
    (["--port=9002"], {"TITO_HOST": "::1", "TITO_PORT": "1"}, ("::1", 9002)),
    ([], {"TITO_PORT": "9003"}, ("127.0.0.1", 9003)),
    (["--help"], {}, None),
    (["--ssl-keyfile", "k.pem"], {}, None),
    (["--config", "c.yaml"], {}, None),
    (["--port", "eighty"], {}, None),
])
def test_the_address_is_known_before_vllm_is_imported(argv: list[str], env: dict[str, str],
                                                     where: tuple[str, int] | None) -> None:
    assert early_bind.address(argv, env) == where


def test_the_early_defaults_are_titos() -> None:
    s = Settings.build(env={})
    assert (s.host, s.port) == (early_bind.DEFAULT_HOST, early_bind.DEFAULT_PORT)


@pytest.fixture
def early() -> Iterator[early_bind.Early]:
    port = free_port()
    e = early_bind.open_early(["--port", str(port)], env={})
    assert e is not None
    yield e
    e.close()


def test_the_port_answers_starting_as_the_app_does(early: early_bind.Early) -> None:
    url = f"http://127.0.0.1:{early.where[1]}"
    app_error = not_started_app(type("App", (), {"state": type("S", (), {})()})())
    with httpx.Client(base_url=url, timeout=5) as c:
        for path, body in (("/health", {"status": "starting"}), ("/ready", {"status": "not_ready", "reason":
                                                                              "starting"})):
            r = c.get(path)
            assert r.status_code == 503 and r.json() == body and r.headers["retry-after"] == "5"
        assert c.get("/liveness").json() == {"status": "starting", "error": app_error.message}
        r = c.post("/inference/v1/generate", json={"token_ids": [1] * 5000, "sampling_params": {"max_tokens": 1}})
        assert r.status_code == 503 and r.json() == app_error.body()
    sock = early.take("127.0.0.1", early.where[1])
    assert sock is not None and sock.fileno() >= 0
    with socket.create_connection(("127.0.0.1", early.where[1]), timeout=2) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        conn.settimeout(0.3)
        with pytest.raises(TimeoutError):
            conn.recv(100)  # nobody answers after take(): the connection waits in the backlog for the app
    assert early.take("127.0.0.1", early.where[1] + 1) is None  # another address: closed, bound again later


def test_a_taken_port_is_an_error_at_once() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(OSError, match="in use"):
            early_bind.open_early(["--port", str(held.getsockname()[1])], env={})


# ------------------------------------------------------------------------------------------------ how many


@pytest.mark.parametrize(("argv", "n"), [
    ([], 1),
    (["--data-parallel-size", "2"], 2),
    (["-dp", "4", "--api-server-count", "1"], 1),
    (["--api-server-count", "3"], 3),
    (["--data-parallel-size", "2", "--data-parallel-external-lb"], 1),
    (["--data-parallel-size", "4", "--data-parallel-size-local", "2", "--data-parallel-hybrid-lb"], 2),
])
def test_how_many_api_processes_as_vllm_serve_counts_them(argv: list[str], n: int, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    assert api_processes(parse_serve([str(tmp_path), *argv], env={})) == n


def test_the_count_reads_its_env_variable(tmp_path: Path) -> None:
    assert api_processes(parse_serve([str(tmp_path)], env={"TITO_API_SERVER_COUNT": "2"})) == 2
    assert os.environ.get("TITO_API_SERVER_COUNT") is None
