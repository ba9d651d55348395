"""Several API processes over the same engine cores (``tito serve --api-server-count N``, N > 1): vLLM's half of it.

vLLM 0.32's own way (``vllm serve``'s ``run_multi_api_server``, ``bind_engine_zmq_listeners``,
``launch_core_engines``), with one difference: the control process, which starts the engine cores, is an engine
client too (the N API processes are clients 0..N-1, it is client N), so that pause, weight updates and LoRA loads run
in a process whose event loop no stream keeps busy. The server's side (forking the API processes, the control plane
they share) is ``app/server/api_processes.py``.

- ``EnginePlan.make``: the engine configuration for N + 1 clients and the raw listeners of every client's two ZMQ
  sockets, bound before anything forks (each client adopts its own; vLLM's engines connect to all of them).
- ``EnginePlan.launch``: the engine cores (and the DP coordinator) started by the control process, and the address
  the coordinator publishes load statistics on, which the API processes' clients subscribe to.
- ``EnginePlan.client``: what ``Engine.start`` needs to make this process's client of those engines.
- ``balanced_server``: vLLM's uvicorn server that accepts each connection in the least loaded API process (an event
  loop's own server accepts every queued connection in whichever process wakes first).
"""

from __future__ import annotations

from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.core.settings import Settings

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    import uvicorn


@dataclass
class ClientPart:
    """One engine client's share of an ``EnginePlan``: its index among the clients, its listeners' addresses and
    sockets, and (the control process only) the engine processes it manages."""

    index: int
    count: int
    addresses: dict[str, Any]
    config: Any  # the VllmConfig shared by all clients
    launched: Any = None  # the control process: vLLM's CoreEngineLaunch (engine manager, coordinator)


@dataclass
class EnginePlan:
    """The engine configuration and every client's listeners, made in the control process before it forks."""

    api_processes: int
    config: Any  # VllmConfig
    listeners: Any  # vLLM's EngineZmqListeners: inputs[i], outputs[i] for client i
    launched: Any = None
    stats_update_address: str | None = None
    _closed: set[int] = field(default_factory=set)

    @property
    def control_index(self) -> int:
        return self.api_processes

    @classmethod
    def make(cls, settings: Settings, api_processes: int) -> EnginePlan:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.utils import bind_engine_zmq_listeners

        from app.engine.engine_setup import engine_args

        args = engine_args(settings)
        args._api_process_count = api_processes + 1  # the control process is a client too
        args._api_process_rank = -1  # as vllm serve's supervisor; each client sets its own
        config = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        return cls(api_processes, config, bind_engine_zmq_listeners(config, api_processes + 1))

    def keep_only(self, index: int) -> None:
        """Close this process's copies of every other client's listeners (not their socket files: those are the
        other clients' to adopt)."""
        for i in range(self.api_processes + 1):
            if i != index and i not in self._closed:
                self.listeners.inputs[i].close()
                self.listeners.outputs[i].close()
                self._closed.add(i)

    def launch(self, publish: Callable[[str | None], None], watched: Sequence[BaseProcess]) -> None:
        """Start the engine cores (blocking until they have loaded the model and are ready: call from a thread).
        ``publish(address)`` hands the coordinator's statistics address to the API processes as soon as it is known,
        so their clients connect while the engines start; ``watched``: the API processes, whose death during the
        start fails it."""
        from vllm.v1.engine.utils import launch_core_engines
        from vllm.v1.executor import Executor

        config = self.config
        with launch_core_engines(config, Executor.get_class(config), True, self.listeners.addresses) as launch:
            launch.watched_frontend_processes = list(watched)
            self.stats_update_address = launch.addresses.frontend_stats_publish_address
            publish(self.stats_update_address)
        self.launched = launch

    def client(self, index: int, stats_update_address: str | None) -> ClientPart:
        addresses: dict[str, Any] = {
            "input_address": self.listeners.inputs[index].address,
            "output_address": self.listeners.outputs[index].address,
            "input_listener": self.listeners.inputs[index].socket,
            "output_listener": self.listeners.outputs[index].socket,
        }
        if stats_update_address is not None:
            addresses["stats_update_address"] = stats_update_address
        self.config.parallel_config._api_process_rank = index
        return ClientPart(index, self.api_processes + 1, addresses, self.config,
                          self.launched if index == self.control_index else None)

    def engine_processes(self) -> list[BaseProcess]:
        """The engine cores and the DP coordinator this process started (to name the one that died)."""
        launch = self.launched
        if launch is None:
            return []
        procs = list(getattr(launch.engine_manager, "processes", None) or [])
        if launch.coordinator is not None:
            procs.append(launch.coordinator.proc)
        return procs


def attach_engines(llm: Any, part: ClientPart) -> None:
    """Make the control process's client the owner of the engine processes it started, as a single-process client
    is: vLLM's monitor marks the engine dead the moment one of them exits, and ``shutdown`` stops them."""
    launch = part.launched
    if launch is None:
        return
    resources = llm.engine_core.resources
    resources.engine_manager = launch.engine_manager
    resources.coordinator = launch.coordinator
    llm.engine_core.start_engine_core_monitor()


def balanced_server(config: uvicorn.Config, loads: MutableSequence[int], index: int) -> uvicorn.Server:
    """vLLM's uvicorn server for one of several API processes on one socket: each publishes its open connections in
    ``loads`` and accepts a pending connection only when it is the least loaded (re-checking for up to 5 ms). It
    installs no signal handlers: the control process owns the server's lifecycle."""
    from vllm.entrypoints.launchers.launcher import NoSignalServer

    return NoSignalServer(config, peer_loads=(loads, index))
