"""Code that runs inside vLLM's worker processes, reached with ``engine.collective_rpc("<method>", ...)``.

vLLM mixes this class into its Worker (``AsyncEngineArgs(worker_extension_cls=...)``), so ``self`` is the worker:
``self.model_runner``, ``self.device``, ``self.vllm_config`` etc. are available. It must stay importable in a freshly
spawned process. Errors the caller caused carry ``CLIENT_ERROR`` so the server answers 4xx, timeouts ``TIMEOUT_ERROR``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

# Shared with app.weights; a stdlib-only module, so the worker's import graph stays small.
from app.weight_markers import BUFFER_SUFFIXES, CLIENT_ERROR, TIMEOUT_ERROR

log = logging.getLogger("tito.worker")

# Sanity bounds on what a trainer announces, so a garbled stream fails fast instead of allocating terabytes.
_MAX_STATE_DICTS = 100_000
_MAX_META_BYTES = 256 * 1024 * 1024


class BroadcastError(RuntimeError):
    pass


class _Broadcaster:
    """The worker's end of the trainer's broadcast group: receive-only, rank 0 is the trainer."""

    def __init__(self, recv: Callable[[Any, float], None], rank: int, world_size: int, backend: str,
                 timeout: float, close: Callable[[], None]) -> None:
        self.recv = recv
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.close = close


class TitoWorkerExtension:
    _tito_bcast: _Broadcaster | None = None

    def liveness_probe(self) -> int:
        """A no-op round trip through every worker: proves the engine loop and workers answer."""
        return os.getpid()

    # ------------------------------------------------------------------------------------------ from disk

    def tito_load_checkpoint(self, files: list[str], skip: list[str]) -> dict[str, Any]:
        """Load already-validated safetensors ``files`` in place with vLLM's ``reload_weights``.

        An iterator over exactly the validated files (not ``weights_path``): vLLM's directory glob could pick up
        other files, buffers listed in ``skip`` must not reach ``load_weights``, and ``weights_path`` would repoint
        the model config at the checkpoint directory.
        """
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        skipped = set(skip)
        t0 = time.perf_counter()
        it = ((n, t) for n, t in safetensors_weights_iterator(list(files), False) if n not in skipped)
        self.reload_weights(weights_iterator=it)  # type: ignore[attr-defined]
        return {"pid": os.getpid(), "seconds": time.perf_counter() - t0}

    # ------------------------------------------------------------------------------------------ broadcast

    def tito_init_broadcaster(self, host: str, port: int, rank_offset: int, inference_world_size: int,
                              timeout: float, backend: str) -> dict[str, Any]:
        """Join the trainer's group as rank ``rank_offset + dp_rank*world + worker_rank + 1`` of
        ``inference_world_size + 1`` (Prime-RL's topology rank; the trainer is rank 0 and hosts the store)."""
        pc = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        per_engine = int(pc.world_size)  # tp * pp
        dp_index = int(pc.data_parallel_index)
        local = int(pc.rank) % per_engine
        rank = rank_offset + dp_index * per_engine + local + 1
        span = int(pc.data_parallel_size) * per_engine
        if rank_offset < 0 or inference_world_size < 1 or rank > inference_world_size:
            raise ValueError(
                f"{CLIENT_ERROR}rank {rank} (rank_offset {rank_offset} + dp_rank {dp_index} x {per_engine} + worker "
                f"{local} + 1) does not fit inference_world_size {inference_world_size}: this server has {span} "
                f"worker(s), so inference_world_size must be at least rank_offset + {span}.")
        self.tito_close_broadcaster()
        world = inference_world_size + 1
        td = timedelta(seconds=timeout)
        t0 = time.perf_counter()
        try:
            if backend == "gloo":
                recv, close = _gloo_group(host, port, rank, world, td)
            elif backend == "nccl":
                recv, close = _nccl_group(host, port, rank, world, timeout, self.device)  # type: ignore[attr-defined]
            else:
                raise ValueError(f"{CLIENT_ERROR}unknown broadcast backend {backend!r} (nccl or gloo).")
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - rendezvous failures become a clear timeout/connect error
            raise BroadcastError(f"{TIMEOUT_ERROR}could not join the trainer's {backend} group at {host}:{port} as "
                                 f"rank {rank}/{world} within {timeout:g}s: {e}") from None
        self._tito_bcast = _Broadcaster(recv, rank, world, backend, timeout, close)
        log.info("joined weight broadcast group %s:%d as rank %d/%d (%s) in %.2fs", host, port, rank, world, backend,
                 time.perf_counter() - t0)
        return {"rank": rank, "world_size": world, "backend": backend}

    def tito_close_broadcaster(self) -> bool:
        b: _Broadcaster | None = getattr(self, "_tito_bcast", None)
        self._tito_bcast = None
        if b is None:
            return False
        try:
            b.close()
        except Exception:  # noqa: BLE001 - a broken group cannot be closed cleanly; dropping it is enough
            pass
        return True

    def tito_receive_broadcast(self, expected: dict[str, list[int]], timeout: float | None = None) -> dict[str, Any]:
        """Receive one update (Prime-RL's wire: count, then per state dict: meta length, pickled meta, one flat
        tensor per dtype), check it against ``expected`` names/shapes, and only then load it."""
        import torch

        from app.safe_pickle import UnsafePickleError, restricted_loads

        b: _Broadcaster | None = getattr(self, "_tito_bcast", None)
        if b is None:
            raise ValueError(f"{CLIENT_ERROR}no broadcast group: call /init_broadcaster first.")
        limit = float(timeout or b.timeout)
        t0 = time.perf_counter()

        def recv(t: torch.Tensor, what: str) -> None:
            try:
                b.recv(t, limit)
            except Exception as e:  # noqa: BLE001 - the group is unusable after a failed collective
                self.tito_close_broadcaster()
                raise BroadcastError(f"{TIMEOUT_ERROR}broadcast receive of {what} failed or timed out after "
                                     f"{limit:g}s ({e}); the group was dropped: call /init_broadcaster "
                                     "again.") from None

        count = torch.zeros(1, dtype=torch.int64, device=self.device)  # type: ignore[attr-defined]
        recv(count, "the state-dict count")
        n = int(count.item())
        if not 0 < n <= _MAX_STATE_DICTS:
            self.tito_close_broadcaster()
            raise ValueError(f"{CLIENT_ERROR}trainer announced {n} state dicts; expected 1..{_MAX_STATE_DICTS}.")
        received: list[tuple[str, torch.Tensor]] = []
        nbytes = 0
        for i in range(n):
            ln = torch.zeros(1, dtype=torch.int64, device=self.device)  # type: ignore[attr-defined]
            recv(ln, f"metadata length {i}")
            size = int(ln.item())
            if not 0 < size <= _MAX_META_BYTES:
                self.tito_close_broadcaster()
                raise ValueError(f"{CLIENT_ERROR}state dict {i}: metadata length {size} out of range.")
            raw = torch.empty(size, dtype=torch.uint8, device=self.device)  # type: ignore[attr-defined]
            recv(raw, f"metadata {i}")
            try:
                meta = _check_meta(restricted_loads(raw.cpu().numpy().tobytes()))
            except (UnsafePickleError, ValueError, TypeError, EOFError, AttributeError) as e:
                self.tito_close_broadcaster()
                raise ValueError(f"{CLIENT_ERROR}state dict {i}: bad metadata: {e}") from None
            for dtype, entries in meta:
                total = sum(numel for _, _, numel in entries)
                flat = torch.empty(total, dtype=dtype, device=self.device)  # type: ignore[attr-defined]
                recv(flat, f"state dict {i} {dtype} data")
                nbytes += flat.numel() * flat.element_size()
                off = 0
                for name, shape, numel in entries:
                    received.append((name, flat[off:off + numel].view(shape)))
                    off += numel
        _check_against(received, expected)
        recv_s = time.perf_counter() - t0
        self.reload_weights(weights_iterator=_skip_buffers(received))  # type: ignore[attr-defined]
        return {"pid": os.getpid(), "bytes": nbytes, "tensors": len(received), "state_dicts": n,
                "receive_seconds": recv_s, "seconds": time.perf_counter() - t0}


def _skip_buffers(items: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    return ((n, t) for n, t in items if not n.endswith(BUFFER_SUFFIXES))


def _check_meta(meta: Any) -> list[tuple[Any, list[tuple[str, tuple[int, ...], int]]]]:
    """``{torch.dtype: [(name, shape, numel), ...]}`` with consistent numbers, or ValueError."""
    import torch

    if not isinstance(meta, dict):
        raise ValueError(f"expected a dict, got {type(meta).__name__}")
    out = []
    for dtype, entries in meta.items():
        if not isinstance(dtype, torch.dtype) or not isinstance(entries, (list, tuple)):
            raise ValueError("keys must be torch dtypes and values lists")
        rows = []
        for e in entries:
            if not isinstance(e, (list, tuple)) or len(e) != 3:
                raise ValueError("entries must be (name, shape, numel)")
            name, shape, numel = e
            if not isinstance(name, str) or not isinstance(numel, int) or not isinstance(shape, (tuple, list)) \
                    or not all(isinstance(x, int) and x >= 0 for x in shape):
                raise ValueError(f"malformed entry for {name!r}")
            if math.prod(shape) != numel:
                raise ValueError(f"{name}: numel {numel} does not match shape {list(shape)}")
            rows.append((name, tuple(shape), numel))
        out.append((dtype, rows))
    return out


def _check_against(received: list[tuple[str, Any]], expected: dict[str, list[int]]) -> None:
    names = {n for n, _ in received}
    if len(names) != len(received):
        raise ValueError(f"{CLIENT_ERROR}broadcast sent a tensor name twice.")
    unknown = sorted(n for n in names if n not in expected and not n.endswith(BUFFER_SUFFIXES))
    if unknown:
        raise ValueError(f"{CLIENT_ERROR}broadcast has {len(unknown)} tensor(s) the model lacks: {unknown[:8]}.")
    missing = sorted(n for n in expected if n not in names)
    if missing:
        raise ValueError(f"{CLIENT_ERROR}broadcast is missing {len(missing)} tensor(s) of the model: {missing[:8]}.")
    for n, t in received:
        want = expected.get(n)
        if want is not None and list(t.shape) != list(want):
            raise ValueError(f"{CLIENT_ERROR}shape mismatch for {n!r}: broadcast has {list(t.shape)}, the model "
                             f"expects {list(want)}.")


def _gloo_group(host: str, port: int, rank: int, world: int,
                timeout: timedelta) -> tuple[Callable[[Any, float], None], Callable[[], None]]:
    """A gloo group beside vLLM's own (vllm-cpu.md): broadcast through the group object, not the global API."""
    import torch
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    pg: Any = stateless_init_torch_distributed_process_group(host, port, rank, world, "gloo", timeout=timeout)

    def recv(t: Any, limit: float) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        pg.broadcast([t], opts).wait(timedelta(seconds=limit))

    def close() -> None:
        pg.shutdown() if hasattr(pg, "shutdown") else None

    return recv, close


def _nccl_group(host: str, port: int, rank: int, world: int, timeout: float,
                device: Any) -> tuple[Callable[[Any, float], None], Callable[[], None]]:
    """The same group Prime-RL's trainer builds: vLLM's StatelessProcessGroup (TCPStore) + PyNcclCommunicator."""
    import torch
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    spg = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world,
                                       store_timeout=int(timeout))
    comm = PyNcclCommunicator(spg, device=device)

    def recv(t: Any, limit: float) -> None:
        # NCCL has no per-call timeout: poll the stream's completion against the deadline.
        stream = torch.cuda.current_stream()
        comm.broadcast(t, src=0, stream=stream)
        event = torch.cuda.Event()
        event.record(stream)
        deadline = time.monotonic() + limit
        while not event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"NCCL broadcast not complete after {limit:g}s")
            time.sleep(0.001)

    def close() -> None:
        return None

    return recv, close
