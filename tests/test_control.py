"""The control plane on a real engine: start-up answers, pause/resume/update ordering, independent shared client ids.

The session's shared long-context server (tests/conftest.py), whose first seconds were recorded as it started: the
port must answer 503 "starting" long before the engine is up. The requests that must stay in flight are endless
(``ENDLESS`` tokens, more than any machine generates within a test); only an abort ends them, so every check that
needs "still running" holds however fast or slow the machine is. Waits are on server-side facts (``/is_paused``,
the control queue in ``/server_info``, tito's in-flight count), never sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.tiny.model import TINY_CONFIG
from tests.conftest import LONG_CONTEXT
from tests.helpers import ServerProcess, engine_env, free_port, metric_value, restore_server, tito_cmd
from tests.streaming import GEN, async_client, inflight, long_context_model, wait_for

pytestmark = pytest.mark.engine

ENDLESS = 60000  # fits the shared long-context server


@pytest.fixture(scope="module")
def started(long_tito: ServerProcess) -> Iterator[tuple[ServerProcess, dict[str, httpx.Response]]]:
    """The shared long-context server and what its port answered first, while its engine was still starting
    (conftest.first_answers). Put back as found at the end of the module."""
    yield long_tito, long_tito.first_answers
    restore_server(long_tito.url)


@pytest.fixture(scope="module")
def server(started: tuple[ServerProcess, dict[str, httpx.Response]]) -> ServerProcess:
    return started[0]


def test_port_answers_503_starting_before_the_engine_is_up(started: tuple[ServerProcess, dict[str, Any]]) -> None:
    _, a = started
    assert a["health"].status_code == 503 and a["health"].json() == {"status": "starting"}
    assert a["ready"].status_code == 503 and a["ready"].json() == {"status": "not_ready", "reason": "starting"}
    assert a["liveness"].status_code == 503 and a["liveness"].json()["status"] == "starting"
    g = a["generate"]
    assert g.status_code == 503 and int(g.headers["retry-after"]) > 0
    assert g.json()["error"]["message"] == "server is starting"
    assert a["pause"].status_code == 503 and a["pause"].json()["error"]["message"] == "server is starting"
    # Still starting a moment later: these answers came well before the engine was up, not at its very end.
    assert a["health_again"].status_code == 503


def test_engine_start_failure_exits_nonzero_with_the_cause(tmp_path: Path) -> None:
    """A configuration vLLM refuses stops the start at once (exit 2, its reason in one line); an engine that fails
    while starting (here: a config without its weights) ends the server with exit 3 and the cause in the log."""
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    out = subprocess.run(tito_cmd(bad, free_port()), capture_output=True, text=True, timeout=240, env=engine_env())
    assert out.returncode == 2, out.stderr
    assert any(line.startswith("tito: vLLM refuses the engine arguments: ") and "no-such-architecture" in line
               for line in out.stderr.splitlines()), out.stderr

    weightless = tmp_path / "no-weights"
    weightless.mkdir()
    (weightless / "config.json").write_text(json.dumps(TINY_CONFIG))
    port = free_port()
    s = ServerProcess(tito_cmd(weightless, port), port, tmp_path / "bad.log", env=engine_env())
    s._log = open(s.log_path, "wb")  # noqa: SIM115 - closed by stop()
    s.proc = subprocess.Popen(s.cmd, stdout=s._log, stderr=subprocess.STDOUT, env=s.env, cwd=str(Path.cwd()),
                              process_group=0)
    try:
        code = s.proc.wait(240)
        assert code == 3, s.log_tail()
        assert "engine failed to start" in s.log_text() and "Cannot find any model weights" in s.log_text()
    finally:
        s.kill()


# ------------------------------------------------------------------------------------------------ helpers


class Stream:
    """One endless SSE request read in the background; its tokens and headers are visible while it runs."""

    def __init__(self, c: httpx.AsyncClient, prompt: int, *, headers: dict[str, str] | None = None,
                 body_id: str | None = None) -> None:
        body: dict[str, Any] = {"token_ids": [1 + prompt, 2, 3], "stream": True,
                                "sampling_params": {"max_tokens": ENDLESS, "temperature": 0, "ignore_eos": True}}
        if body_id is not None:
            body["request_id"] = body_id
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.ids: set[str] = set()
        self.engine_id = ""
        self.first = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(c, body, headers))

    async def _run(self, c: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str] | None) -> None:
        async with c.stream("POST", GEN, json=body, headers=headers) as r:
            assert r.status_code == 200
            self.engine_id = r.headers["x-engine-request-id"]
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                self.ids.add(ev["request_id"])
                for ch in ev["choices"]:
                    self.tokens += ch["token_ids"]
                    self.finish = ch["finish_reason"] or self.finish
                self.first.set()

    async def grows(self) -> None:
        """Wait until this stream has produced more tokens than it has now (it is generating)."""
        n = len(self.tokens)

        async def more() -> bool:
            return len(self.tokens) > n

        await wait_for(more, 120, interval=0.02)


async def _control(c: httpx.AsyncClient) -> dict[str, Any]:
    return dict((await c.get("/server_info")).json()["state"]["control"])


async def _paused(c: httpx.AsyncClient) -> bool:
    return bool((await c.get("/is_paused")).json()["is_paused"])


@contextlib.asynccontextmanager
async def _generating(c: httpx.AsyncClient, prompt: int) -> AsyncIterator[Stream]:
    """One endless stream that has produced its first token; afterwards the server is resumed and idle again."""
    s = Stream(c, prompt)
    try:
        await asyncio.wait_for(s.first.wait(), 120)
        yield s
    finally:
        await _cleanup(c, [s])


async def _cleanup(c: httpx.AsyncClient, streams: list[Stream]) -> None:
    await c.post("/resume")
    await c.post("/abort_requests", json={})
    for s in streams:
        s.task.cancel()
    await asyncio.gather(*(s.task for s in streams), return_exceptions=True)

    async def idle() -> bool:
        return await inflight(c) == 0

    await wait_for(idle, 30)


# ------------------------------------------------------------------------------------------------ shared ids


def test_requests_sharing_a_client_id_are_independent(server: ServerProcess) -> None:
    async def run() -> None:
        async with async_client(server.url) as c:
            streams: list[Stream] = []
            try:
                a = Stream(c, 1, headers={"X-Request-Id": "twin"})
                b = Stream(c, 2, body_id="twin")
                streams += [a, b]
                await asyncio.wait_for(asyncio.gather(a.first.wait(), b.first.wait()), 120)
                assert a.ids == b.ids == {"generate-tokens-twin"}  # the answer keeps the client's id
                assert a.engine_id != b.engine_id and a.engine_id.startswith("generate-tokens-twin-")

                # One client leaves: only its request ends; the other keeps generating.
                a.task.cancel()
                await asyncio.gather(a.task, return_exceptions=True)
                await wait_for(lambda: _inflight_is(c, 1), 30)
                await b.grows()

                # An abort by engine id ends exactly that request.
                c1 = Stream(c, 3, headers={"X-Request-Id": "twin"})
                streams.append(c1)
                await asyncio.wait_for(c1.first.wait(), 120)
                r = await c.post("/abort_requests", json={"request_ids": [b.engine_id]})
                assert r.json() == {"status": "aborted", "aborted": 1}
                await asyncio.wait_for(b.task, 60)
                assert b.finish == "abort"
                await c1.grows()
                assert not c1.task.done()

                # An abort by the client's id ends every request that carries it.
                d = Stream(c, 4, body_id="twin")
                streams.append(d)
                await asyncio.wait_for(d.first.wait(), 120)
                r = await c.post("/abort_requests", json={"request_ids": ["twin"]})
                assert r.json() == {"status": "aborted", "aborted": 2}
                await asyncio.wait_for(asyncio.gather(c1.task, d.task), 60)
                assert c1.finish == d.finish == "abort"
            finally:
                await _cleanup(c, streams)

    asyncio.run(run())


async def _inflight_is(c: httpx.AsyncClient, k: int) -> bool:
    return await inflight(c) == k


# ------------------------------------------------------------------------------------------------ pause/resume


def test_a_timed_out_pause_wait_is_cancelled(server: ServerProcess) -> None:
    async def run() -> None:
        async with async_client(server.url) as c:
            async with _generating(c, 5) as s:
                r = await c.post("/pause", params={"mode": "wait", "timeout": 1})
                assert r.status_code == 504 and "cancelled" in r.json()["error"]["message"], r.text
                # Nothing of the pause is left: not paused, the request generates, new requests are admitted.
                assert not await _paused(c)
                await s.grows()
                ok = await c.post(GEN, json={"token_ids": [7, 8], "sampling_params": {"max_tokens": 3}})
                assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 3
                assert (await _control(c))["recent"][-1] == {"call": "pause (mode=wait)", "outcome": "504"}

    asyncio.run(run())


def test_resume_supersedes_a_draining_pause(server: ServerProcess) -> None:
    async def run() -> None:
        async with async_client(server.url) as c:
            async with _generating(c, 6) as s:
                pause = asyncio.ensure_future(c.post("/pause", params={"mode": "wait", "timeout": 600}))
                await wait_for(lambda: _paused(c), 60)  # admission stopped: the pause is draining
                r = await c.post("/resume")
                assert r.status_code == 200, r.text
                p = await asyncio.wait_for(pause, 60)
                assert p.status_code == 409 and "superseded" in p.json()["error"]["message"], p.text
                assert not await _paused(c)  # the last call won
                await s.grows()
                recent = (await _control(c))["recent"][-2:]
                assert recent == [{"call": "pause (mode=wait)", "outcome": "409"}, {"call": "resume", "outcome": "ok"}]

    asyncio.run(run())


def test_pause_update_and_resume_run_in_arrival_order(server: ServerProcess, tmp_path_factory:
                                                      pytest.TempPathFactory) -> None:
    ckpt = long_context_model(tmp_path_factory.mktemp("control-ckpt") / "step_1", LONG_CONTEXT)

    async def run() -> None:
        async with async_client(server.url) as c:
            async with _generating(c, 7) as s:
                # The drain of this pause cannot end while the endless request runs: it holds the control lock.
                pause_wait = asyncio.ensure_future(c.post("/pause", params={"mode": "wait", "timeout": 600}))
                await wait_for(lambda: _running(c, "pause (mode=wait)"), 60)
                update = asyncio.ensure_future(c.post("/update_weights", json={"weight_dir": str(ckpt),
                                                                                "weight_version": "ordered-1"}))
                await wait_for(lambda: _queued(c, 1), 60)
                keep = asyncio.ensure_future(c.post("/pause", params={"mode": "keep"}))
                await wait_for(lambda: _queued(c, 2), 60)
                assert not pause_wait.done() and not update.done() and not keep.done()
                # Ending the request lets the drain finish; the queue then runs in arrival order.
                r = await c.post("/abort_requests", json={"request_ids": [s.engine_id]})
                assert r.json()["aborted"] == 1
                answers = await asyncio.wait_for(asyncio.gather(pause_wait, update, keep), 120)
                assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
                assert answers[1].json()["weight_version"] == "ordered-1"
                recent = [x["call"] for x in (await _control(c))["recent"][-3:]]
                assert recent == ["pause (mode=wait)", "weight update (disk)", "pause (mode=keep)"]
                # The pause sent during the update holds: the update did not resume the engine under it.
                assert await _paused(c)
                assert (await c.post("/resume")).status_code == 200
                assert not await _paused(c)

    asyncio.run(run())



def test_a_pause_whose_client_leaves_still_ends_whole(server: ServerProcess) -> None:
    """The HTTP routes run their transition in the handler's own task (no shielding task): a client that gives up on
    a draining pause leaves it running, and it completes once the drain ends, as if the client had stayed."""

    async def run() -> None:
        async with async_client(server.url) as c:
            async with _generating(c, 9) as s:
                async with httpx.AsyncClient(base_url=server.url) as impatient:
                    with pytest.raises(httpx.ReadTimeout):
                        await impatient.post("/pause", params={"mode": "wait", "timeout": 600}, timeout=1.0)
                # The client has gone; the pause has not: it still drains, holding the control plane.
                assert (await _control(c))["running"] == "pause (mode=wait)"
                r = await c.post("/abort_requests", json={"request_ids": [s.engine_id]})
                assert r.json()["aborted"] == 1

                async def settled() -> bool:
                    return (await _control(c))["running"] is None

                await wait_for(settled, 60)
                assert (await _control(c))["recent"][-1] == {"call": "pause (mode=wait)", "outcome": "ok"}
                assert await _paused(c)
                assert (await c.get("/server_info")).json()["state"]["paused"] is True

    asyncio.run(run())


async def _running(c: httpx.AsyncClient, name: str) -> bool:
    return (await _control(c))["running"] == name


async def _queued(c: httpx.AsyncClient, k: int) -> bool:
    return int((await _control(c))["queued"]) >= k


# ------------------------------------------------------------------------------------------------ tito's record


def test_is_paused_answers_from_titos_record_and_matches_the_engine(server: ServerProcess) -> None:
    """/is_paused answers from what tito last told the scheduler (no round trip behind the step in progress);
    /server_info asks the engine itself. The two agree through every kind of pause, a frozen request and a resume,
    and each transition's time is in tito_control_seconds, the loop's lag in tito_event_loop_lag_seconds."""

    async def both(c: httpx.AsyncClient) -> tuple[bool, bool]:
        engine = (await c.get("/server_info")).json()["state"]["paused"]
        return await _paused(c), engine

    async def run() -> None:
        async with async_client(server.url) as c:
            before = (await c.get("/metrics")).text
            assert await both(c) == (False, False)
            async with _generating(c, 8) as s:
                assert (await c.post("/pause", params={"mode": "keep"})).status_code == 200
                assert await both(c) == (True, True)
                frozen = len(s.tokens)
                assert (await c.post("/resume")).status_code == 200
                assert await both(c) == (False, False)
                await s.grows()  # the frozen request went on
                assert len(s.tokens) > frozen
                assert (await c.post("/pause", params={"mode": "abort"})).status_code == 200
                assert await both(c) == (True, True)
                await asyncio.wait_for(s.task, 60)
                assert s.finish == "abort"
                assert (await c.post("/resume")).status_code == 200
                assert await both(c) == (False, False)
            after = (await c.get("/metrics")).text
            for call, n in (("pause_keep", 1), ("pause_abort", 1), ("resume", 2)):
                labels = {"call": call, "part": "run"}
                grew = (metric_value(after, "tito_control_seconds_count", labels) or 0) - \
                    (metric_value(before, "tito_control_seconds_count", labels) or 0)
                assert grew >= n, (call, grew)
            assert (metric_value(after, "tito_event_loop_lag_seconds_count") or 0) > 0

    asyncio.run(run())
