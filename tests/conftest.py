"""Shared fixtures: the session's servers (real vLLM engines, tiny model, fp32), each started ahead of the first test
that uses it, one at a time, while the tests before it run (``SharedServers``); the tests without an engine run first.

- ``tito``: the default server (no extra flags but ``--grpc-port``). Read-only tests and tests that put back what
  they change.
- ``long_tito``: the tiny model with a 60,096-token context (room for endless requests), a short liveness bound,
  the worker's test-only fault hook and the staged-delta copy in a memory-mapped file (``--delta-copy file``; the
  other servers keep it in memory, the default); started while the port's first answers are recorded
  (``first_answers``). The modules that change weights, pause, abort and broadcast share it and put it back
  (``restore_server``).
- ``lora_tito``: LoRA on (rank 8, two adapters) and the opt-in ``--stream-interval 4``, on the tiny model with a
  4,192-token context (``LORA_CONTEXT``).
- ``vllm_ref``: vLLM's own server on the tiny model, the reference of the compatibility tests: its token API
  (``--enable-scale-out``) for test_vllm_compat.py, and, with the model's tokenizer, its text and evaluation routes
  for test_vllm_compat_eval.py.
- ``sidecar_a`` / ``sidecar_b``: two replicas for vLLM's native gRPC services and Dynamo's sidecar in front of them
  (``--grpc-port``, KV events, 32-token blocks, LoRA; served as ``tiny``; ``b`` runs its own sidecar with
  ``--dynamo-namespace``). test_sidecar_grpc.py uses ``a``; test_sidecar_serve.py both, and stops ``b`` at its end.
- ``keyed_tito``: both API keys (``DATA_KEY``, ``ADMIN_KEY``, from the environment), LoRA, JSON request logs, small
  request caps and tokens only (``--skip-tokenizer-init``): the end-to-end server of test_client.py, test_openai.py
  and test_security_e2e.py. Each module using it restores it at its end (``restore_server`` with the admin key).
- ``grpc_a``: ``--grpc-port`` on grpcio's server (``--grpc-server grpcio``; every other server's gRPC is the default
  native one), KV events, 32-token blocks, 5 logprobs: tito's gRPC surface (test_grpc.py, test_grpc_events.py). Its
  second replica ``grpc_b`` (no KV events, no LoRA, for vllm.Inference's prompt logprobs, the smg gateway in front
  of both and the SIGTERM test) is the default server, which also serves gRPC; the SIGTERM test ends it after its
  last user.
- ``fuzz_tito``: the admin key alone (the data plane open), LoRA, a 64-token context, 4 sequences, 5 logprobs:
  test_fuzz.py's server.
- ``prime_tito``: started with the command line Prime-RL's own launcher builds (its defaults for a Qwen3 model:
  processed logprobs, hermes tool calls, an fp32 LM head), on the tiny *tied* model, served as ``Qwen/Qwen3-0.6B``, at
  tito's engine defaults (compiled, as Prime-RL runs vLLM): test_launchers.py, then test_prime_rl_writer.py (Prime-RL's
  trainer writer and admin client; updates its weights).
- ``api2``: Prime-RL's launcher's command line for data parallel 2, from which its config derives
  ``--api-server-count 2`` (two API processes and the control process: app/server/api_processes.py), on the tiny tied
  model, with LoRA, gRPC and KV events added: test_dp.py, then test_api_servers.py, whose SIGTERM test ends it.

A test that ends its server (SIGTERM, a killed engine) takes a shared one at the end of its life instead of starting
its own: ``@pytest.mark.ends_server("<name>")`` runs it right after the last test using that server, and its
``ending_server`` fixture hands the server over (a fresh one if it is gone, e.g. on a rerun). The flags those tests
need are on the shared servers, where nothing else observes them: ``--engine-death-exit-delay``,
``--exit-on-engine-death false``, ``--shutdown-timeout``.

Modules whose flags change what every test there observes (other small caps, data parallel, KV-cache size, another
model) keep their own, registered with ``module_server`` so that it is started ahead too.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil
import pytest

from app.tiny.model import make_tiny_model
from tests import budget
from tests.helpers import (
    EAGER_ENV,
    OFFLINE_ENV,
    ServerProcess,
    Wait,
    current_module,
    engine_env,
    free_port,
    tito_cmd,
    vllm_cmd,
)
from tests.streaming import GEN, long_context_model

if TYPE_CHECKING:
    from tests.grpc_client import Replica


def pytest_configure(config: pytest.Config) -> None:
    # Every server of the run records its committed weights (--state-dir's default, $XDG_STATE_HOME/tito/...) in a
    # directory of this run: no record of an earlier run is restored, none is left behind in the home directory.
    if not os.environ.get("TITO_TEST_STATE_HOME"):
        os.environ["TITO_TEST_STATE_HOME"] = os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="tito-state-")
    # The suite's engines run eagerly unless a test says otherwise (``engine_env``), in-process ones too: a compiled
    # start (tito's default, as vLLM's) costs seconds more even on the tiny model, over ~25 starts. The default server
    # runs at the defaults (``_builtin_starts``); Prime-RL's launcher's servers pass --no-enforce-eager, as it does.
    os.environ.setdefault(EAGER_ENV, "1")
    # Nothing the suite starts may install or resolve a package, or fetch a model: set-up (the Makefile) installs
    # everything first. On a warm machine a resolution at run time would quietly succeed from the caches and fail on a
    # user's fresh one; offline, it fails here too.
    os.environ.update(OFFLINE_ENV)
    config.addinivalue_line("markers", "engine: needs a real vLLM engine (slow start)")
    config.addinivalue_line("markers", "ends_server(name): ends the shared server ``name`` (runs after its last user)")
    config.pluginmanager.register(budget, "tito-budget")  # time per module and the budget check, at the end


# Fixtures that start a real engine (or hand one over), or need what only an engine test may (the tiny model written
# to disk). A test depending on any of them, directly or through another fixture, must be marked ``engine``
# (``pytestmark = pytest.mark.engine`` in its module, or ``@pytest.mark.engine``): collection fails otherwise, and a
# server started during a test without the mark fails that test (``ServerProcess.engine_allowed``), so ``make unit``
# (``-m "not engine"``) never starts an engine.
ENGINE_FIXTURES = frozenset({"tito", "tito_url", "tiny_model", "long_tito", "lora_tito", "vllm_ref", "keyed_tito",
                             "fuzz_tito", "shared_servers", "ending_server", "sidecar_a", "sidecar_b", "grpc_a",
                             "grpc_b", "reference", "prime_tito", "api2"})


def unmarked_engine_tests(items: list[pytest.Item]) -> list[str]:
    return [item.nodeid for item in items if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ()))
            and item.get_closest_marker("engine") is None]


def pytest_unconfigure(config: pytest.Config) -> None:
    state = os.environ.pop("TITO_TEST_STATE_HOME", None)
    if state and os.path.basename(state).startswith("tito-state-"):
        shutil.rmtree(state, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unmarked = unmarked_engine_tests(items)
    if unmarked:
        raise pytest.UsageError("tests using an engine fixture without the engine mark (pytest.mark.engine):\n  "
                                + "\n  ".join(unmarked))
    _engine_tests_last(items)
    _run_enders_after_last_use(items)


def _engine_tests_last(items: list[pytest.Item]) -> None:
    """The tests without an engine first (in their order), then the others: the first servers start while the fast
    tests run (``SharedServers``)."""
    items[:] = [i for i in items if i.get_closest_marker("engine") is None] + \
        [i for i in items if i.get_closest_marker("engine") is not None]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    ServerProcess.engine_allowed = item.get_closest_marker("engine") is not None
    try:
        yield
    finally:
        ServerProcess.engine_allowed = None


def ends_server(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("ends_server")
    return str(marker.args[0]) if marker else None


def _uses(item: pytest.Item, name: str) -> bool:
    if name in MODULE_SERVERS:  # a module's own server: its engine tests use it
        return (getattr(getattr(item, "module", None), "__name__", None) == MODULE_SERVERS[name][0]
                and item.get_closest_marker("engine") is not None)
    return name in getattr(item, "fixturenames", ()) or ends_server(item) == name


# A module's own server (flags no other module shares), registered at collection by ``module_server``: its name, the
# module, and the start (``start(tmp_path_factory, tiny_model)``). ``shared_servers.get(name)`` hands it over, started
# ahead like the shared ones; it is killed after the module.
MODULE_SERVERS: dict[str, tuple[str, Callable[[pytest.TempPathFactory, Path], ServerProcess]]] = {}


def module_server(name: str) -> Callable[[Callable[[pytest.TempPathFactory, Path], ServerProcess]],
                                         Callable[[pytest.TempPathFactory, Path], ServerProcess]]:
    def register(start: Callable[[pytest.TempPathFactory, Path], ServerProcess]) \
            -> Callable[[pytest.TempPathFactory, Path], ServerProcess]:
        MODULE_SERVERS[name] = (start.__module__, start)
        return start

    return register


def _run_enders_after_last_use(items: list[pytest.Item]) -> None:
    """Move each test marked ``ends_server(name)`` after the module of the last other test that uses ``name`` (in
    place when none does: it then gets a server of its own)."""
    for item in [i for i in items if ends_server(i)]:
        name = ends_server(item)
        assert name is not None
        at = items.index(item)
        items.remove(item)
        last = max((k for k, other in enumerate(items) if _uses(other, name)), default=None)
        if last is None:
            items.insert(at, item)
            continue
        module = getattr(items[last], "module", None)
        while last + 1 < len(items) and getattr(items[last + 1], "module", None) is module:
            last += 1
        items.insert(last + 1, item)


@pytest.fixture(scope="session")
def tiny_model(request: pytest.FixtureRequest) -> Path:
    """The embedded default model, written fresh for the session (deterministic from its seed)."""
    shared = _shared(request.session)
    assert shared is not None
    return shared.tiny_model


def start_timeout(factor: float = 1.0) -> float:
    return float(os.environ.get("TITO_TEST_START_TIMEOUT", "240")) * factor


def start_tito(tmp_path_factory: pytest.TempPathFactory, model: Path, *extra: str,
               env: Mapping[str, str | None] | None = None, name: str = "tito", timeout: float | None = None,
               on_answer: Callable[[ServerProcess], Any] | None = None) -> ServerProcess:
    """Start a tito server subprocess on a free port; the test temp tree is an allowed weight root.

    Between ``free_port()`` releasing the port and the server binding it, any outgoing connection on the machine may
    take that ephemeral port. Such a start fails with "address already in use" and is retried on another port."""
    for attempt in range(3):
        port = free_port()
        cmd = tito_cmd(model, port, "--allowed-weight-root", str(tmp_path_factory.getbasetemp()), *extra)
        log = tmp_path_factory.mktemp("logs") / f"{name}.log"
        server = ServerProcess(cmd, port, log, env=engine_env(env))
        try:
            return server.start(timeout=timeout or start_timeout(), on_answer=on_answer)
        except RuntimeError:
            server.kill()  # no EngineCore left behind
            if attempt == 2 or "address already in use" not in server.log_text().lower():
                raise
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------- shared servers

LONG_CONTEXT = 60096  # endless requests (60,000 tokens) after a prompt of a few tokens
# ``keyed_tito``'s API keys: the data plane's and the admin plane's.
DATA_KEY, ADMIN_KEY = "data-key-3f9c", "admin-key-81d2"
KEYED_MAX_MODEL_LEN, KEYED_MAX_NUM_SEQS = 128, 4
LORA_CONTEXT = 4192  # the 4,000-token streams of test_engine_failure.py's stay-up test, after a short prompt
FUZZ_ADMIN_KEY = "fuzz-admin-key-6b1e"
FUZZ_MAX_MODEL_LEN = 64
GRPC_BLOCK = 32  # grpc_a's KV block size: a few blocks of prompt publish KV events


# What the default server answers right after its start, before any test can change it: a never-updated engine's
# answers (``tito.fresh_answers``), test_weights.py's "same as a fresh engine on these weights".
FRESH_BODIES = [{"token_ids": [3, 1, 4, 1, 5], "sampling_params": {"max_tokens": 12, "temperature": 0, "logprobs": 2}},
                *({"token_ids": p, "sampling_params": {"max_tokens": 16, "temperature": 0}}
                  for p in ([1, 2, 3, 4, 5], [17, 300, 42, 9]))]


def fresh_answers(s: ServerProcess) -> list[dict[str, Any]]:
    with httpx.Client(base_url=s.url, timeout=120.0) as c:
        answers = [c.post(GEN, json=body) for body in FRESH_BODIES]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    return [r.json()["choices"][0] for r in answers]


def first_answers(s: ServerProcess) -> dict[str, httpx.Response]:
    """Every kind of route, asked at the port's first answer while the engine is still starting."""
    with httpx.Client(base_url=s.url, timeout=5.0) as c:
        return {"health": c.get("/health"), "ready": c.get("/ready"), "liveness": c.get("/liveness"),
                "generate": c.post(GEN, json={"token_ids": [1], "sampling_params": {"max_tokens": 1}}),
                "pause": c.post("/pause"), "health_again": c.get("/health")}


def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where ``long_tito``'s worker looks for a fault to inject into its next weight load (``TITO_TEST_FAULT_FILE``,
    app/engine/worker.py); read and removed by that load, so without the file every load is normal."""
    return tmp_path_factory.getbasetemp() / "long-tito-fault"


class SharedServers:
    """The session's servers, started ahead of the modules that use them: one at a time, in a thread of their own, in
    the order the tests will first ask for them, while the tests before run. An engine start keeps one core busy for
    40 to 65 s (vLLM's imports in three processes, one after the other; the worker's model set-up), which started when
    first asked for the tests waited for in full. Ahead, it takes the CPU the tests leave idle: on two cores the suite
    is bound by CPU, so this moves the starts more than it saves (the waits fell from 943 to 421 s of a ~1,510 s run,
    the wall time stayed); with more cores the waits go. At most ``AHEAD`` servers are started and not used yet, at most
    ``MAX_LIVE`` alive, and a start ahead waits for ``MIN_AVAILABLE`` memory. A server asked for before it was
    started ahead starts at once (``get``). Each is killed after the last module that uses it (``release_unused``;
    started again if a rerun asks for it), the rest at the end of the session."""

    AHEAD, MAX_LIVE = 3, 5
    # Room a start ahead must find: the server (~3 GB resident: its worker ~1.8 GB with the 1 GiB KV cache, the API
    # process and EngineCore ~0.6 GB each) and what the tests beside it may load (the bench smoke's two in-process
    # engines, Dynamo's processes, reference models). The machine has no swap: running out kills an engine.
    MIN_AVAILABLE = 10 * 2**30

    def __init__(self, session: pytest.Session, starts: dict[str, Callable[[], ServerProcess]],
                 tiny_model: Path) -> None:
        self.session = session
        self.starts = starts
        self.tiny_model = tiny_model
        self.futures: dict[str, Future[ServerProcess]] = {}
        self.used: set[str] = set()  # asked for by a test (``get``, ``take``)
        self.pool = ThreadPoolExecutor(len(starts))  # starts a test waits for
        self.ahead_pool = ThreadPoolExecutor(1)
        self.ahead: Future[ServerProcess] | None = None  # the start ahead in progress (one at a time)
        self.index = {id(item): k for k, item in enumerate(session.items)}
        # For each server, the indices of the tests that use it.
        self.uses = {n: [k for k, item in enumerate(session.items) if _uses(item, n)] for n in starts}

    def _start_ahead(self, name: str) -> ServerProcess:
        ServerProcess.ahead.active = True
        try:
            return self.starts[name]()
        finally:
            ServerProcess.ahead.active = False

    def prefetch(self, item: pytest.Item) -> None:
        """Before ``item``: start the next server the tests from ``item`` on use, unless a start ahead is running or a
        limit holds (checked again before the next test)."""
        at = self.index.get(id(item))
        if at is None or (self.ahead is not None and not self.ahead.done()):
            return
        upcoming = sorted((uses[bisect_left(uses, at)], n) for n, uses in self.uses.items()
                          if n not in self.futures and uses and uses[-1] >= at)
        started_unused = sum(1 for n in self.futures if n not in self.used)
        if (not upcoming or started_unused >= self.AHEAD or len(self.futures) >= self.MAX_LIVE
                or psutil.virtual_memory().available < self.MIN_AVAILABLE):
            return
        name = upcoming[0][1]
        self.futures[name] = self.ahead = self.ahead_pool.submit(self._start_ahead, name)

    def _settle(self, name: str, f: Future[ServerProcess]) -> None:
        """Wait for ``name``'s start to end (up or failed), counting the wait against the running test's module."""
        t0 = time.monotonic()
        f.exception()
        ServerProcess.waits.append(Wait(current_module(), name, time.monotonic() - t0))

    def get(self, name: str) -> ServerProcess:
        self.used.add(name)
        f = self.futures.get(name)
        # Not started yet, or still queued behind another start ahead: start it now, beside that one.
        if f is None or f.cancel():
            self.futures[name] = self.pool.submit(self.starts[name])
        self._settle(name, self.futures[name])
        return self.futures[name].result()  # the start's error, if it failed

    def take(self, name: str) -> ServerProcess:
        """Hand ``name`` over to a test that ends it: the running one (no later test uses it, see
        ``_run_enders_after_last_use``), or a new one when it is gone (a rerun) or was never started."""
        self.used.add(name)
        f = self.futures.pop(name, None)
        if f is not None and not f.cancel():  # queued ahead and not begun: cancelled, started here
            self._settle(name, f)
            if f.exception() is None:
                server = f.result()
                if server.proc is not None and server.proc.poll() is None:
                    return server
                server.kill()
        return self.starts[name]()

    def release_unused(self, item: pytest.Item) -> None:
        """After ``item``'s module: kill the servers no later test uses (frees their memory). Not ``tito``: its
        fixture is session-scoped (cached), and most modules use it."""
        at = self.index.get(id(item), -1)
        needed = {n for n, uses in self.uses.items() if uses and uses[-1] > at} | {"tito"}
        for name in [n for n in self.futures if n not in needed and self.futures[n].done()]:
            f = self.futures.pop(name)
            if f.exception() is None:
                f.result().kill()

    def kill_all(self) -> None:
        self.ahead_pool.shutdown(cancel_futures=True)
        for f in self.futures.values():
            if not f.cancelled() and f.exception() is None:
                f.result().kill()
        self.futures.clear()
        self.pool.shutdown()


_SHARED: list[SharedServers] = []


def _shared(session: pytest.Session, create: bool = True) -> SharedServers | None:
    """The session's ``SharedServers``, made at the first test when any selected test uses a server (or when a
    fixture asks): the tiny model written, every start known."""
    if not _SHARED and (create or any(_uses(i, n) for i in session.items for n in (*_BUILTIN, *MODULE_SERVERS))):
        factory = session.config._tmp_path_factory  # type: ignore[attr-defined]  # what tmp_path_factory returns
        model = make_tiny_model(factory.mktemp("model") / "tiny-qwen3")
        starts = _builtin_starts(factory, model)
        for name, (_, start) in MODULE_SERVERS.items():
            starts[name] = (lambda start=start: start(factory, model))  # type: ignore[misc]
        _SHARED.append(SharedServers(session, starts, model))
    return _SHARED[0] if _SHARED else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    shared = _shared(item.session, create=False)
    if shared is not None:
        shared.prefetch(item)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _SHARED:
        _SHARED.pop().kill_all()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    if _SHARED and (nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None)):
        _SHARED[0].release_unused(item)


# The shared servers' names (``SharedServers``): a test uses one through the fixture of that name.
_BUILTIN = ("tito", "long_tito", "lora_tito", "keyed_tito", "fuzz_tito", "vllm_ref", "sidecar_a", "sidecar_b", "grpc_a",
            "prime_tito", "api2")


def _builtin_starts(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) \
        -> dict[str, Callable[[], ServerProcess]]:
    # Several engine starts at once on two cores: each takes longer than alone.
    timeout = start_timeout(2.5)

    def default() -> ServerProcess:
        # --grpc-port: the second gRPC replica of test_grpc*.py (``grpc_b``), whose SIGTERM test ends this server
        # after its last user; nothing else observes the gRPC port.
        grpc_port = free_port()
        # At tito's engine defaults (torch.compile, chunked prefill), which the exactness tests then check.
        s = start_tito(tmp_path_factory, tiny_model, "--grpc-port", str(grpc_port), env={EAGER_ENV: None},
                       timeout=timeout)
        s.grpc_port = grpc_port
        s.fresh_answers = fresh_answers(s)
        return s

    def long() -> ServerProcess:
        model = long_context_model(tmp_path_factory.mktemp("long-model") / "tiny-long", LONG_CONTEXT)
        # --liveness-timeout 5: the probes asked while a broadcast blocks the worker must answer well within the
        # broadcast's timeout (test_weight_integrity.py); nothing else here depends on it. The exit delay: for
        # test_engine_failure.py's death test, which ends this server (time for its checks after the kill).
        return start_tito(tmp_path_factory, model, "--max-model-len", str(LONG_CONTEXT), "--liveness-timeout", "5",
                          "--engine-death-exit-delay", "20", "--delta-copy", "file",
                          env={"TITO_TEST_FAULT_FILE": str(fault_file(tmp_path_factory))}, name="tito-long",
                          timeout=timeout, on_answer=first_answers)

    def lora() -> ServerProcess:
        # The context and the engine-death flags: for test_engine_failure.py's stay-up test, which ends this server
        # (streams of 4,000 tokens still running when it kills the engine).
        model = long_context_model(tmp_path_factory.mktemp("lora-model") / "tiny-lora", LORA_CONTEXT)
        return start_tito(tmp_path_factory, model, "--max-model-len", str(LORA_CONTEXT), "--enable-lora",
                          "--max-lora-rank", "8", "--max-loras", "2", "--stream-interval", "4",
                          "--exit-on-engine-death", "false", "--engine-death-exit-delay", "0.5", name="tito-lora",
                          timeout=timeout)

    def keyed() -> ServerProcess:
        # Both keys from the environment, as a deployment would pass them; LoRA; JSON request logs; small request caps
        # (test_security_e2e.py's limits). 16 KV blocks (2,048 tokens, four full-length sequences): it idles between
        # its users, and the default 1 GiB cache would be held for nothing. Tokens only (--skip-tokenizer-init): the
        # suite's tokens-only engine (test_openai.py checks its text routes refuse, its token-id completions work).
        return start_tito(tmp_path_factory, tiny_model, "--skip-tokenizer-init", "--enable-lora", "--max-lora-rank",
                          "8", "--log-requests",
                          "--log-format", "json", "--max-model-len", str(KEYED_MAX_MODEL_LEN), "--num-kv-blocks", "16",
                          "--max-num-seqs", str(KEYED_MAX_NUM_SEQS),
                          "--max-logprobs", "5", "--max-stop-token-ids", "4", "--max-logit-bias", "2",
                          "--max-body-bytes", "65536", "--shutdown-timeout", "600",
                          env={"TITO_API_KEY": DATA_KEY, "TITO_ADMIN_API_KEY": ADMIN_KEY}, name="tito-keyed",
                          timeout=timeout)

    def fuzz() -> ServerProcess:
        # Small caps keep valid generations short: at most 4 sequences of at most 64 tokens. The shutdown timeout: for
        # test_lifecycle.py's second-signal test, which ends this server.
        return start_tito(tmp_path_factory, tiny_model, "--enable-lora", "--max-model-len", str(FUZZ_MAX_MODEL_LEN),
                          "--max-num-seqs", "4", "--max-logprobs", "5", "--shutdown-timeout", "600",
                          env={"TITO_ADMIN_API_KEY": FUZZ_ADMIN_KEY}, name="tito-fuzz", timeout=timeout)

    def sidecar_replica(name: str, own_sidecar: bool) -> Callable[[], ServerProcess]:
        def start() -> ServerProcess:
            from tests.sidecar import NS, dynamo_env, dynamo_kv_dir, system_port

            # VLLM_HOST_IP: the KV-event publishers' free ports (--kv-events-port 0) bind loopback. 512 blocks of
            # 32 tokens (16,384 tokens) hold every prompt of the KV-routing test many times over.
            extra: tuple[str, ...] = ()
            env = {"VLLM_HOST_IP": "127.0.0.1"}
            if own_sidecar:  # `tito serve --dynamo-namespace`: tito runs Dynamo's sidecar as its child
                extra = ("--dynamo-namespace", NS, "--dynamo-system-port", str(system_port()))
                env.update(dynamo_env(dynamo_kv_dir(tmp_path_factory.getbasetemp())))
            return start_tito(tmp_path_factory, tiny_model, "--served-model-name", "tiny", "--grpc-port",
                              str(free_port()), "--kv-events-port", "0", "--block-size", "32", "--num-kv-blocks",
                              "512", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", *extra,
                              env=env, name=name, timeout=timeout)

        return start

    def grpc_replica(name: str, *extra: str, env: dict[str, str] | None = None) -> Callable[[], ServerProcess]:
        def start() -> ServerProcess:
            # No API key: smg 1.13 sends none to gRPC workers (test_grpc_auth.py tests the keys).
            grpc_port = free_port()
            s = start_tito(tmp_path_factory, tiny_model, "--grpc-port", str(grpc_port), "--max-logprobs", "5", *extra,
                           env=env, name=name, timeout=timeout)
            s.grpc_port = grpc_port
            return s

        return start

    def prime() -> ServerProcess:
        from app.tiny.model import make_tiny_model
        from tests.prime_rl_src import launcher_argv

        model = make_tiny_model(tmp_path_factory.mktemp("tied-model") / "tiny-tied", tied=True)
        port = free_port()
        argv = [*launcher_argv(port, model), "--num-kv-blocks", "16", "--allowed-weight-root",
                str(tmp_path_factory.getbasetemp())]
        log = tmp_path_factory.mktemp("logs") / "prime-tito.log"
        # At tito's engine defaults (torch.compile), as Prime-RL runs its inference server: the tied head's updates
        # (full, broadcast, staged delta: test_prime_rl_writer.py) are checked on the compiled model.
        server = ServerProcess([sys.executable, "-m", "tito", "serve", *argv], port, log,
                               env=engine_env({EAGER_ENV: None}))
        server.launch_argv = argv  # type: ignore[attr-defined]
        return server.start(timeout=timeout)

    def api2() -> ServerProcess:
        from app.tiny.model import make_tiny_model
        from tests.prime_rl_src import launcher_argv

        model = make_tiny_model(tmp_path_factory.mktemp("tied-dp-model") / "tiny-tied", tied=True)
        port, grpc_port = free_port(), free_port()
        # Prime-RL's own arguments for dp = 2 (it sets --api-server-count 2 itself), then what the tests add: LoRA, gRPC
        # and KV events (test_dp.py), a small KV cache per engine core, the weight root, and a drain long enough for
        # the SIGTERM test's streams. VLLM_HOST_IP: the KV-event publishers' free ports on loopback.
        argv = [*launcher_argv(port, model, data_parallel_size=2), "--enable-lora", "--max-lora-rank", "8",
                "--grpc-port", str(grpc_port), "--kv-events-port", "0", "--num-kv-blocks", "64",
                "--allowed-weight-root", str(tmp_path_factory.getbasetemp()), "--shutdown-timeout", "120"]
        log = tmp_path_factory.mktemp("logs") / "api2.log"
        server = ServerProcess([sys.executable, "-m", "tito", "serve", *argv], port, log,
                               env=engine_env({"VLLM_HOST_IP": "127.0.0.1"}))
        server.launch_argv = argv  # type: ignore[attr-defined]
        server.grpc_port = grpc_port
        return server.start(timeout=timeout)

    def vllm() -> ServerProcess:
        port = free_port()
        log = tmp_path_factory.mktemp("logs") / "vllm.log"
        # At vLLM's default engine mode, as the default tito server it is compared with (its chunks' fingerprint, a
        # hash of the engine's configuration, then equals tito's).
        return ServerProcess(vllm_cmd(tiny_model, port, tokens_only=False, eager=False), port, log,
                             env=engine_env({"VLLM_SERVER_DEV_MODE": "1"})).start(timeout=timeout)

    return {"tito": default, "long_tito": long, "lora_tito": lora, "keyed_tito": keyed, "fuzz_tito": fuzz,
            "vllm_ref": vllm, "prime_tito": prime, "api2": api2, "sidecar_a": sidecar_replica("sidecar-a", False),
            "sidecar_b": sidecar_replica("sidecar-b", True),
            # KV events (SubscribeKvEvents; VLLM_HOST_IP: the publisher's free ports on loopback).
            # grpcio's server (the other servers serve gRPC on the default, pygrpc-native's): both kinds run the
            # exactness tests and sit behind the smg gateway together.
            "grpc_a": grpc_replica("grpc-a", "--kv-events-port", "0", "--block-size", str(GRPC_BLOCK),
                                   "--grpc-server", "grpcio", env={"VLLM_HOST_IP": "127.0.0.1"})}


@pytest.fixture(scope="session")
def shared_servers(request: pytest.FixtureRequest) -> SharedServers:
    shared = _shared(request.session)
    assert shared is not None
    return shared


@pytest.fixture(scope="session")
def tito(shared_servers: SharedServers) -> ServerProcess:
    """The shared default server. Tests must leave it as they found it (not paused, not draining, base weights)."""
    return shared_servers.get("tito")


# Module-scoped: each module asks the pool again, which starts a server anew if it was released and a rerun needs it.
@pytest.fixture(scope="module")
def long_tito(shared_servers: SharedServers) -> ServerProcess:
    """The shared long-context server (see the module docstring). Each module using it restores it at its end."""
    return shared_servers.get("long_tito")


@pytest.fixture(scope="module")
def prime_tito(shared_servers: SharedServers) -> ServerProcess:
    """Prime-RL's launcher's own command line (its defaults for a Qwen3 model: processed logprobs, hermes tool calls,
    an fp32 LM head) on the tiny tied model, as the seed's Qwen3-0.6B ties its head, at tito's engine defaults
    (compiled) (test_launchers.py, then test_prime_rl_writer.py, which updates its weights)."""
    return shared_servers.get("prime_tito")


@pytest.fixture(scope="module")
def api2(shared_servers: SharedServers) -> ServerProcess:
    """Prime-RL's launcher's command line for data parallel 2: two API processes (see the module docstring)."""
    return shared_servers.get("api2")


@pytest.fixture(scope="module")
def lora_tito(shared_servers: SharedServers) -> ServerProcess:
    """The shared LoRA server (test_cli.py, test_lora.py, test_lora_exactness.py, test_trainers.py). Each module using
    it restores it at its end and unloads the adapters it loaded."""
    return shared_servers.get("lora_tito")


@pytest.fixture(scope="module")
def keyed_tito(shared_servers: SharedServers) -> ServerProcess:
    """The shared server with API keys (test_client.py, test_security_e2e.py). Each module using it restores it at its
    end."""
    return shared_servers.get("keyed_tito")


@pytest.fixture(scope="module")
def fuzz_tito(shared_servers: SharedServers) -> ServerProcess:
    """The shared fuzzing server (test_fuzz.py; the admin key alone). Put back at the end of the module."""
    return shared_servers.get("fuzz_tito")


@pytest.fixture
def ending_server(request: pytest.FixtureRequest, shared_servers: SharedServers) -> Iterator[ServerProcess]:
    """The shared server the test's ``ends_server`` marker names, handed over at the end of its life; killed after the
    test, whatever the test did to it."""
    name = ends_server(request.node)
    assert name is not None, "ending_server needs @pytest.mark.ends_server(<shared server>)"
    server = shared_servers.take(name)
    yield server
    server.kill()


@pytest.fixture(scope="module")
def vllm_ref(shared_servers: SharedServers) -> ServerProcess:
    """vLLM's own server on the tiny model (test_vllm_compat.py, test_vllm_compat_eval.py)."""
    return shared_servers.get("vllm_ref")


@pytest.fixture(scope="module")
def sidecar_a(shared_servers: SharedServers) -> ServerProcess:
    """The first replica for vLLM's native gRPC services (see the module docstring). Modules restore it at their end."""
    return shared_servers.get("sidecar_a")


@pytest.fixture(scope="module")
def sidecar_b(shared_servers: SharedServers) -> ServerProcess:
    """The second replica, with its own Dynamo sidecar: test_sidecar_serve.py stops it with its last test."""
    return shared_servers.get("sidecar_b")


@pytest.fixture(scope="module")
def grpc_a(shared_servers: SharedServers) -> Replica:
    """tito with ``--grpc-port`` and KV events (test_grpc.py, test_grpc_events.py)."""
    from tests.grpc_client import Replica

    s = shared_servers.get("grpc_a")
    assert s.grpc_port is not None
    return Replica(s, s.grpc_port)


@pytest.fixture(scope="module")
def grpc_b(tito: ServerProcess) -> Replica:
    """The second gRPC replica, without KV events or LoRA: the default server's gRPC port (test_grpc_events.py's
    SIGTERM test ends that server, after its last user)."""
    from tests.grpc_client import Replica

    assert tito.grpc_port is not None
    return Replica(tito, tito.grpc_port)


@pytest.fixture(scope="session")
def tito_url(tito: ServerProcess) -> str:
    return tito.url


@pytest.fixture
def client(tito_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tito_url, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="session")
def reference(tiny_model: Path):  # noqa: ANN201 - returns tests.reference.Reference
    from tests.reference import Reference

    return Reference(tiny_model)
