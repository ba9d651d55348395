"""The calls into tito's worker extension (``worker``, ``worker_delta``, ``worker_broadcast``, ``worker_areal``): one
collective RPC each, by the method name the workers register. Shared by the engine adapter and the test suite's fake
of it, so both send the same names and arguments."""

from __future__ import annotations

from typing import Any


class WorkerCalls:
    """Needs ``collective_rpc``: every worker runs ``method`` and the list of their answers comes back."""

    async def collective_rpc(self, method: str, *, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                             timeout: float | None = None) -> list[Any]:
        raise NotImplementedError

    async def load_checkpoint(self, files: list[str], skip: list[str]) -> list[Any]:
        """Load validated safetensors files into every worker, in place (vLLM's ``reload_weights``)."""
        return await self.collective_rpc("tito_load_checkpoint", kwargs={"files": files, "skip": skip})

    async def delta_prepare(self, version: str, files: list[str] | None, delta: dict[str, str] | None = None,
                            copy_dir: str | None = None) -> list[Any]:
        """Every worker makes sure its host copy of the weights holds ``version`` (fills it from ``files`` in the
        background if not, in memory or, with ``copy_dir``, in a memory-mapped file there; app/engine/worker_delta.py).
        Returns each worker's copy status at once."""
        return await self.collective_rpc("tito_delta_prepare", kwargs={"version": version, "files": files,
                                                                       "delta": delta, "copy_dir": copy_dir})

    async def delta_status(self) -> list[Any]:
        """Each worker's host copy: version, state (empty, filling, ready, error), size."""
        return await self.collective_rpc("tito_delta_status")

    async def delta_layout(self, shapes: dict[str, list[int]]) -> list[Any]:
        """Each worker: where these HF tensors' elements land in vLLM's parameters, and which are written in place."""
        return await self.collective_rpc("tito_delta_trace", kwargs={"shapes": shapes})

    async def delta_commit(self, path: str, base: str, version: str) -> list[Any]:
        """Every worker applies the prepared delta at ``path`` on top of ``base`` (under the pause)."""
        return await self.collective_rpc("tito_delta_commit", kwargs={"path": path, "base": base, "version": version})

    async def init_broadcaster(self, **kw: Any) -> list[Any]:
        """Every worker joins the trainer's weight-broadcast group (Prime-RL's NCCL protocol; gloo on CPU)."""
        return await self.collective_rpc("tito_init_broadcaster", kwargs=kw)

    async def receive_broadcast(self, expected: dict[str, list[int]], timeout: float,
                                tied_to: str | None = None) -> list[Any]:
        """Receive one broadcast of state dicts from the trainer, validate it, and load it (``tied_to``: the
        embedding a tied model's head is, whose copy the trainer sends as ``lm_head.weight``)."""
        return await self.collective_rpc("tito_receive_broadcast",
                                         kwargs={"expected": expected, "timeout": timeout, "tied_to": tied_to})

    async def close_broadcaster(self) -> list[Any]:
        return await self.collective_rpc("tito_close_broadcaster")

    async def areal(self, step: str, **kw: Any) -> list[Any]:  # AReaL's sync: app/engine/worker_areal.py
        return await self.collective_rpc(f"tito_areal_{step}", kwargs=kw)
