"""The trainer's NCCL/gloo weight broadcast, on the worker's side (mixed into ``app.engine.worker``'s
``TitoWorkerExtension``).

Joining the trainer's group (Prime-RL's topology: the trainer is rank 0 and hosts the store), receiving one update in
Prime-RL's wire format state dict by state dict, checking each against the model's tensors before it reaches the
model, and loading it with the worker's checked reload (``_tito_reload``, app/engine/worker.py). Errors the caller
caused carry ``CLIENT_ERROR``, timeouts ``TIMEOUT_ERROR``, failures that left the model as it was ``UNTOUCHED``.
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
from app.engine.rendezvous import wait_for_store
from app.engine.weight_markers import BUFFER_SUFFIXES, CLIENT_ERROR, TIMEOUT_ERROR, UNTOUCHED

log = logging.getLogger("tito.worker")

# Sanity bounds on what a trainer announces, so a garbled stream fails fast instead of allocating terabytes.
_MAX_STATE_DICTS = 100_000
_MAX_META_BYTES = 256 * 1024 * 1024


class BroadcastError(RuntimeError):
    pass


class Broadcaster:
    """The worker's end of the trainer's broadcast group: receive-only, rank 0 is the trainer."""

    def __init__(self, recv: Callable[[Any, float], None], rank: int, world_size: int, backend: str,
                 timeout: float, close: Callable[[], None]) -> None:
        self.recv = recv
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.close = close


class BroadcastWorker:
    """The broadcast RPCs of the worker extension (``self`` is vLLM's worker)."""

    _tito_bcast: Broadcaster | None = None

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
            if backend not in ("gloo", "nccl"):
                raise ValueError(f"{CLIENT_ERROR}unknown broadcast backend {backend!r} (nccl or gloo).")
            wait_for_store(host, port, timeout)
            if backend == "gloo":
                recv, close = _gloo_group(host, port, rank, world, td)
            else:
                recv, close = _nccl_group(host, port, rank, world, timeout, self.device)  # type: ignore[attr-defined]
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - rendezvous failures become a clear timeout/connect error
            raise BroadcastError(f"{TIMEOUT_ERROR}could not join the trainer's {backend} group at {host}:{port} as "
                                 f"rank {rank}/{world} within {timeout:g}s: {e}") from None
        self._tito_bcast = Broadcaster(recv, rank, world, backend, timeout, close)
        log.info("joined weight broadcast group %s:%d as rank %d/%d (%s) in %.2fs", host, port, rank, world, backend,
                 time.perf_counter() - t0)
        return {"rank": rank, "world_size": world, "backend": backend}

    def tito_close_broadcaster(self) -> bool:
        b: Broadcaster | None = getattr(self, "_tito_bcast", None)
        self._tito_bcast = None
        if b is None:
            return False
        try:
            b.close()
        except Exception:  # noqa: BLE001 - a broken group cannot be closed cleanly; dropping it is enough
            pass
        return True

    def tito_receive_broadcast(self, expected: dict[str, list[int]], timeout: float | None = None,
                               tied_to: str | None = None) -> dict[str, Any]:
        """Receive one update (Prime-RL's wire: count, then per state dict: meta length, pickled meta, one flat
        tensor per dtype) and load each state dict as it arrives, so the device never holds a second copy of the
        weights (one state dict, a layer in Prime-RL's order, at most).

        Each state dict's names and shapes are checked against ``expected`` before it reaches the model; the first
        one is received in full before the reload starts, so a trainer that fails at once (bad metadata, a stalled
        group) leaves the model untouched (errors carry ``UNTOUCHED``). A failure after that leaves a partly loaded
        model: the server marks its weights inconsistent.
        """
        b: Broadcaster | None = getattr(self, "_tito_bcast", None)
        if b is None:
            raise ValueError(f"{UNTOUCHED}{CLIENT_ERROR}no broadcast group: call /init_broadcaster first.")
        self.tito_delta_reset()  # type: ignore[attr-defined]
        rx = _Receiver(self, b, float(timeout or b.timeout), expected, tied_to)
        t0 = time.perf_counter()
        try:
            n = rx.count()
            first = rx.state_dict(0)
        except Exception as e:  # noqa: BLE001 - nothing has reached the model yet
            raise BroadcastError(f"{UNTOUCHED}{e}") from None

        def stream() -> Iterator[tuple[str, Any]]:
            ahead = _ReceiveAhead(rx, n)  # the next state dict arrives while vLLM loads this one
            try:
                yield from _skip_buffers(first)
                first.clear()  # drop the references as vLLM consumes them
                for i in range(1, n):
                    yield from _skip_buffers(ahead.get(i))
            finally:
                ahead.stop()
            rx.check_complete()

        kept = self._tito_reload(stream())  # type: ignore[attr-defined]
        return {"pid": os.getpid(), "bytes": rx.nbytes, "tensors": len(rx.seen), "state_dicts": n,
                "seconds": time.perf_counter() - t0, "skipped": sorted(rx.tied_heads), **kept}


class _ReceiveAhead:
    """Receives state dicts 1..n-1 in a thread, one ahead of the loader: the transfer of the next state dict
    overlaps vLLM's load (and processing) of the current one, as a read of the next file overlaps it on disk. At most
    two state dicts are held (one loading, the next arriving or arrived); the receiver's own bounded waits still
    apply, and a failure in the thread reaches the loader at its next state dict."""

    def __init__(self, rx: _Receiver, n: int) -> None:
        import queue
        import threading

        self.rx, self.n = rx, n
        self.out: queue.Queue[tuple[int, Any, BaseException | None]] = queue.Queue()
        self.credit = threading.Semaphore(1)  # receive the next one only once the loader took the last
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tito-bcast-recv", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for i in range(1, self.n):
            while not self.credit.acquire(timeout=0.5):
                if self.stopped.is_set():
                    return
            if self.stopped.is_set():
                return
            try:
                self.out.put((i, self.rx.state_dict(i), None))
            except BaseException as e:  # noqa: BLE001 - handed to the loader, which raises it
                self.out.put((i, None, e))
                return

    def get(self, i: int) -> list[tuple[str, Any]]:
        import queue

        try:  # the receive in the thread is bounded by the receiver's limit: this only backs it up
            got, sd, err = self.out.get(timeout=self.rx.limit + 60.0)
        except queue.Empty:
            raise self.rx._fail(BroadcastError(f"{TIMEOUT_ERROR}state dict {i} of the broadcast did not arrive "
                                               f"within {self.rx.limit:g}s; the group was dropped: call "
                                               "/init_broadcaster again.")) from None
        self.credit.release()
        if err is not None:
            raise err
        assert got == i, (got, i)
        return sd  # type: ignore[no-any-return]

    def stop(self) -> None:
        """The loader is done (or failed): the thread stops before its next receive (a receive under way ends with
        the sender's data, or with the group dropped on a failure)."""
        self.stopped.set()


class _Receiver:
    """Receives one broadcast update, state dict by state dict, checking each against the model's tensors."""

    def __init__(self, worker: Any, b: Broadcaster, limit: float, expected: dict[str, list[int]],
                 tied_to: str | None = None) -> None:
        self.worker, self.b, self.limit, self.expected = worker, b, limit, expected
        self.device = worker.device
        self.seen: set[str] = set()
        self.nbytes = 0
        self.tied_to = tied_to if tied_to in expected else None
        self.tied_heads: set[str] = set()
        self._emb: Any = None  # a tied pair's first half, until the other arrives
        self._heads: dict[str, Any] = {}

    def is_tied_head(self, name: str) -> bool:
        return self.tied_to is not None and name.endswith("lm_head.weight") and name not in self.expected

    def _tied(self, out: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """Check a tied head's copy against the embedding (the first to arrive waits for the other), drop it."""

        for name, t in out:
            if name == self.tied_to:
                self._emb = t
            elif self.is_tied_head(name):
                self._heads[name] = t
                self.tied_heads.add(name)
        if self._emb is not None and self._heads:
            for head, t in self._heads.items():
                if not _same(t, self._emb):
                    raise self._fail(ValueError(f"{CLIENT_ERROR}{head!r} differs from {self.tied_to!r}: the model "
                                                "ties its head to the embedding (tie_word_embeddings), so the head "
                                                "may come only as a copy of the embedding."))
            self._emb, self._heads = None, {}
        return [(n, t) for n, t in out if not self.is_tied_head(n)]

    def _fail(self, exc: Exception) -> Exception:
        # The group is unusable after a failed or abandoned collective: drop it (aborts an NCCL communicator).
        self.worker.tito_close_broadcaster()
        return exc

    def recv(self, t: Any, what: str) -> None:
        try:
            self.b.recv(t, self.limit)
        except Exception as e:  # noqa: BLE001
            raise self._fail(BroadcastError(
                f"{TIMEOUT_ERROR}broadcast receive of {what} failed or timed out after {self.limit:g}s ({e}); the "
                "group was dropped: call /init_broadcaster again.")) from None

    def count(self) -> int:
        import torch

        count = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.recv(count, "the state-dict count")
        n = int(count.item())
        if not 0 < n <= _MAX_STATE_DICTS:
            raise self._fail(ValueError(f"{CLIENT_ERROR}trainer announced {n} state dicts; expected "
                                        f"1..{_MAX_STATE_DICTS}."))
        return n

    def state_dict(self, i: int) -> list[tuple[str, Any]]:
        import torch

        from app.engine.safe_pickle import UnsafePickleError, restricted_loads

        ln = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.recv(ln, f"metadata length {i}")
        size = int(ln.item())
        if not 0 < size <= _MAX_META_BYTES:
            raise self._fail(ValueError(f"{CLIENT_ERROR}state dict {i}: metadata length {size} out of range."))
        raw = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.recv(raw, f"metadata {i}")
        try:
            meta = _check_meta(restricted_loads(raw.cpu().numpy().tobytes()))
        except (UnsafePickleError, ValueError, TypeError, EOFError, AttributeError) as e:
            raise self._fail(ValueError(f"{CLIENT_ERROR}state dict {i}: bad metadata: {e}")) from None
        try:
            _check_part([(name, shape) for _, rows in meta for name, shape, _ in rows], self.expected, self.seen,
                        self.tied_to)
        except ValueError as e:
            raise self._fail(e) from None
        out: list[tuple[str, Any]] = []
        for dtype, entries in meta:
            flat = torch.empty(sum(numel for _, _, numel in entries), dtype=dtype, device=self.device)
            self.recv(flat, f"state dict {i} {dtype} data")
            self.nbytes += flat.numel() * flat.element_size()
            off = 0
            for name, shape, numel in entries:
                out.append((name, flat[off:off + numel].view(shape)))
                off += numel
        return self._tied(out) if self.tied_to is not None else out

    def check_complete(self) -> None:
        missing = sorted(n for n in self.expected if n not in self.seen)
        if missing:
            raise ValueError(f"{CLIENT_ERROR}broadcast is missing {len(missing)} tensor(s) of the model: "
                             f"{missing[:8]}.")


def _same(a: Any, b: Any) -> bool:
    """Equal values: bit for bit in one dtype (no widening copy of an embedding-sized tensor), else as float64."""
    import torch

    if a.dtype == b.dtype and a.shape == b.shape:
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
        if ints is not None and a.is_contiguous() and b.is_contiguous():
            return bool(torch.equal(a.view(ints), b.view(ints)))
    return bool(torch.equal(a.to(torch.float64), b.to(torch.float64)))


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


def _check_part(names: list[tuple[str, tuple[int, ...]]], expected: dict[str, list[int]], seen: set[str],
                tied_to: str | None = None) -> None:
    """One state dict's names and shapes against the model's; ``seen`` collects names across the update; a tied
    head's copy (``tied_to``: the embedding it is) must have the embedding's shape."""
    if tied_to is not None:
        expected = {**expected, **{n: expected[tied_to] for n, _ in names if n.endswith("lm_head.weight")
                                   and n not in expected}}
    unknown = sorted(n for n, _ in names if n not in expected and not n.endswith(BUFFER_SUFFIXES))
    if unknown:
        raise ValueError(f"{CLIENT_ERROR}broadcast has {len(unknown)} tensor(s) the model lacks: {unknown[:8]}.")
    for n, shape in names:
        if n in seen:
            raise ValueError(f"{CLIENT_ERROR}broadcast sent tensor {n!r} twice.")
        seen.add(n)
        want = expected.get(n)
        if want is not None and list(shape) != list(want):
            raise ValueError(f"{CLIENT_ERROR}shape mismatch for {n!r}: broadcast has {list(shape)}, the model "
                             f"expects {list(want)}.")


def _gloo_group(host: str, port: int, rank: int, world: int,
                timeout: timedelta) -> tuple[Callable[[Any, float], None], Callable[[], None]]:
    """A gloo group beside vLLM's own (vllm-cpu.md): broadcast through the group object, not the global API."""
    import torch
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    pg: Any = stateless_init_torch_distributed_process_group(host, port, rank, world, "gloo", timeout=timeout)
    gave_up: list[bool] = []

    def recv(t: Any, limit: float) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        try:
            pg.broadcast([t], opts).wait(timedelta(seconds=limit))
        except BaseException:
            gave_up.append(True)  # the receive may still be pending in gloo's thread
            raise

    def close() -> None:
        pg.shutdown() if hasattr(pg, "shutdown") else None
        if gave_up:
            _ABANDONED_GROUPS.append(pg)

    return recv, close


# Gloo groups dropped with a receive given up on (a timed-out broadcast, the trainer still connected). Letting one go
# runs ProcessGroupGloo's destructor, which waits for that receive until the group's own timeout (init_broadcaster's
# ``timeout``; Prime-RL's default is 1200 s): the worker, and so every generation, would hang that long after the
# update had already answered 504. Kept referenced instead; the receive ends in gloo's own thread.
_ABANDONED_GROUPS: list[Any] = []


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
        # After a timeout the broadcast may still be pending on the stream: abort the communicator (vLLM's destroy
        # runs ncclCommAbort in a thread with a 5 s bound) so it neither hangs nor is reused; the store goes with it.
        comm.destroy()

    return recv, close
