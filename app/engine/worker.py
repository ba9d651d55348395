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

from app.engine.rendezvous import wait_for_store

# Shared with app.weights; a stdlib-only module, so the worker's import graph stays small.
from app.engine.weight_markers import BUFFER_SUFFIXES, CLIENT_ERROR, TIMEOUT_ERROR, UNTOUCHED, inject_fault
from app.engine.worker_areal import ArealWorker
from app.engine.worker_delta import DeltaWorker

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


class TitoWorkerExtension(DeltaWorker, ArealWorker):
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
        self.tito_delta_reset()  # the staged-delta copy mirrors the weights this replaces (worker_delta.py)
        t0 = time.perf_counter()
        it = ((n, t) for n, t in safetensors_weights_iterator(list(files), False) if n not in skipped)
        kept = self._tito_reload(inject_fault(it))
        return {"pid": os.getpid(), "seconds": time.perf_counter() - t0, **kept}

    def _tito_reload(self, weights: Iterable[tuple[str, Any]], partial: bool = False) -> dict[str, Any]:
        """vLLM's in-place ``reload_weights``, with its per-layer report checked: a layer the checkpoint should have
        covered but that loaded nothing fails the update. Returns what was kept as is (layers holding only
        non-checkpoint buffers) and a digest of the rotary caches before and after, for the server's one INFO line.
        ``partial`` (a delta's layers): unfed layers are kept; the caller checks ``not_loaded`` itself."""
        report = watch_reload_log(self.model_runner.get_model())  # type: ignore[attr-defined]
        report.reset(partial)
        before = self.tito_buffer_digests()
        t0 = time.perf_counter()
        try:
            self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
        except BaseException:
            self._tito_abandon_reload()
            raise
        reload_s = time.perf_counter() - t0
        if report.failed:
            raise RuntimeError(f"layer(s) failed to load: {'; '.join(report.failed[:8])}")
        # reload_seconds: vLLM's own reload (reading the tensors included), what tito adds is measured against it.
        return {"kept": dict(report.kept), "rotary_before": _digest_of(before), "not_loaded": sorted(report.not_loaded),
                "rotary_after": _digest_of(self.tito_buffer_digests()), "reload_seconds": reload_s}

    def _tito_abandon_reload(self) -> None:
        """After a reload that failed midway, end vLLM's layerwise bookkeeping (``finalize_layerwise_reload``: puts
        back layers that loaded nothing, processes partly loaded ones, forgets the buffered tensors). Without it the
        next reload would skip re-initializing those layers and mix tensors buffered by the failed one into its own.
        The model stays a mix of versions either way: the server marks it inconsistent."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        try:
            finalize_layerwise_reload(self.model_runner.get_model(),  # type: ignore[attr-defined]
                                      self.vllm_config.model_config)  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - the original failure is what the caller must see
            log.error("could not finalize the failed reload: %s", e)

    def tito_buffer_digests(self, contains: str = "rotary") -> dict[str, str]:
        """``dtype:shape:sha256`` of every named buffer whose name contains ``contains`` (the rotary caches), to
        prove a reload leaves them bit-identical."""
        import hashlib

        import torch

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        out = {}
        for name, buf in model.named_buffers():
            if contains in name:
                t = buf.detach().contiguous().cpu()
                raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
                out[name] = f"{t.dtype}:{list(t.shape)}:{hashlib.sha256(raw).hexdigest()}"
        return out

    def tito_lora_wraps_logits(self) -> bool:  # LoRA on the LM head: no prompt logprobs (app/engine/sampling.py)
        from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA as Lora
        return any(isinstance(m, Lora) for m in self.model_runner.get_model().modules())  # type: ignore[attr-defined]

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
        tensor per dtype) and load each state dict as it arrives, so the device never holds a second copy of the
        weights (one state dict, a layer in Prime-RL's order, at most).

        Each state dict's names and shapes are checked against ``expected`` before it reaches the model; the first
        one is received in full before the reload starts, so a trainer that fails at once (bad metadata, a stalled
        group) leaves the model untouched (errors carry ``UNTOUCHED``). A failure after that leaves a partly loaded
        model: the server marks its weights inconsistent.
        """
        b: _Broadcaster | None = getattr(self, "_tito_bcast", None)
        if b is None:
            raise ValueError(f"{UNTOUCHED}{CLIENT_ERROR}no broadcast group: call /init_broadcaster first.")
        self.tito_delta_reset()
        rx = _Receiver(self, b, float(timeout or b.timeout), expected)
        t0 = time.perf_counter()
        try:
            n = rx.count()
            first = rx.state_dict(0)
        except Exception as e:  # noqa: BLE001 - nothing has reached the model yet
            raise BroadcastError(f"{UNTOUCHED}{e}") from None

        def stream() -> Iterator[tuple[str, Any]]:
            yield from _skip_buffers(first)
            first.clear()  # drop the references as vLLM consumes them
            for i in range(1, n):
                yield from _skip_buffers(rx.state_dict(i))
            rx.check_complete()

        kept = self._tito_reload(stream())
        return {"pid": os.getpid(), "bytes": rx.nbytes, "tensors": len(rx.seen), "state_dicts": n,
                "seconds": time.perf_counter() - t0, **kept}


class _Receiver:
    """Receives one broadcast update, state dict by state dict, checking each against the model's tensors."""

    def __init__(self, worker: Any, b: _Broadcaster, limit: float, expected: dict[str, list[int]]) -> None:
        self.worker, self.b, self.limit, self.expected = worker, b, limit, expected
        self.device = worker.device
        self.seen: set[str] = set()
        self.nbytes = 0

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
            _check_part([(name, shape) for _, rows in meta for name, shape, _ in rows], self.expected, self.seen)
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
        return out

    def check_complete(self) -> None:
        missing = sorted(n for n in self.expected if n not in self.seen)
        if missing:
            raise ValueError(f"{CLIENT_ERROR}broadcast is missing {len(missing)} tensor(s) of the model: "
                             f"{missing[:8]}.")


# ------------------------------------------------------------------------------------------ reload report

# Buffers vLLM computes at start-up and no checkpoint holds (rotary caches). A layer that holds only these loads nothing
# on a reload, so vLLM's layerwise reload warns "<Layer>: Failed to load weights" and puts them back unchanged, which
# is right: the warning is dropped for such layers and said once per update at INFO instead.
NON_CHECKPOINT_BUFFERS = frozenset({"cos_sin_cache", "cos_sin_k_cache", "cos_sin_q_cache", "cos_sin_q_inter_cache",
                                    "cos_sin_qc_cache", "inv_freq"})
_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_INPLACE_LOGGER = "vllm.model_executor.model_loader.reload.inplace"


class ReloadReport(logging.Filter):
    """A filter on vLLM's reload loggers: counts layers kept as is, collects real failures, drops only the
    warnings about layers whose every instance holds nothing but ``NON_CHECKPOINT_BUFFERS``."""

    def __init__(self, benign: set[str]) -> None:
        super().__init__()
        self.benign = benign  # layer class names whose instances hold only non-checkpoint buffers
        self.kept: dict[str, int] = {}
        self.failed: list[str] = []
        self.partial = False  # a delta's reload: the layers it does not feed load nothing
        self.not_loaded: set[str] = set()

    def reset(self, partial: bool = False) -> None:
        self.kept, self.failed, self.partial, self.not_loaded = {}, [], partial, set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        msg = str(record.msg)
        if msg.endswith("Failed to load weights") and record.args:
            layer = str(record.args[0] if isinstance(record.args, tuple) else record.args)
            if layer in self.benign or self.partial:
                self.kept[layer] = self.kept.get(layer, 0) + 1
                return False
            self.failed.append(f"{layer}: nothing loaded")
        elif msg.startswith("Following weights were not loaded"):
            if isinstance(record.args, tuple) and record.args and isinstance(record.args[0], (set, frozenset)):
                self.not_loaded = {str(n) for n in record.args[0]}
            if self.partial:
                return False  # the delta checks these against what it fed
            self.failed.append(record.getMessage())
        return True


_REPORT: ReloadReport | None = None


def _digest_of(digests: dict[str, str]) -> str:
    """One short digest over named buffer digests (order-independent)."""
    import hashlib

    return hashlib.sha256("\n".join(f"{k}={v}" for k, v in sorted(digests.items())).encode()).hexdigest()[:16]


def benign_layer_classes(model: Any) -> set[str]:
    """Class names all of whose instances in ``model`` hold no parameter and only non-checkpoint buffers."""
    verdict: dict[str, bool] = {}
    for module in model.modules():
        params = [n for n, p in module._parameters.items() if p is not None]
        buffers = [n for n, b in module._buffers.items() if b is not None]
        ok = not params and bool(buffers) and all(b in NON_CHECKPOINT_BUFFERS for b in buffers)
        name = type(module).__name__
        verdict[name] = verdict.get(name, True) and ok
    return {n for n, ok in verdict.items() if ok}


def watch_reload_log(model: Any = None) -> ReloadReport:
    """Install (once per worker process) the filter on vLLM's reload loggers and return it."""
    global _REPORT
    if _REPORT is None:
        _REPORT = ReloadReport(benign_layer_classes(model) if model is not None else set())
        logging.getLogger(_LAYERWISE_LOGGER).addFilter(_REPORT)
        logging.getLogger(_INPLACE_LOGGER).addFilter(_REPORT)
    return _REPORT


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


def _check_part(names: list[tuple[str, tuple[int, ...]]], expected: dict[str, list[int]], seen: set[str]) -> None:
    """One state dict's names and shapes against the model's; ``seen`` collects names across the update."""
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
