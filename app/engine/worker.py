"""Code that runs inside vLLM's worker processes, reached with ``engine.collective_rpc("<method>", ...)``.

vLLM mixes this class into its Worker (``AsyncEngineArgs(worker_extension_cls=...)``), so ``self`` is the worker:
``self.model_runner``, ``self.device``, ``self.vllm_config`` etc. are available. It must stay importable in a freshly
spawned process. Errors the caller caused carry ``CLIENT_ERROR`` so the server answers 4xx, timeouts ``TIMEOUT_ERROR``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import Any

# Shared with app.weights; a stdlib-only module, so the worker's import graph stays small.
from app.engine import vllm_patches_weights
from app.engine.vllm_patches import install as install_vllm_patches
from app.engine.vllm_patches_weights import is_tied_head
from app.engine.weight_markers import inject_fault
from app.engine.worker_areal import ArealWorker
from app.engine.worker_broadcast import BroadcastWorker
from app.engine.worker_delta import DeltaWorker

log = logging.getLogger("tito.worker")

# vLLM imports this module in each worker process to mix the extension into its Worker, before the Worker exists:
# the one place tito's fixes to vLLM are applied (app/engine/vllm_patches.py).
install_vllm_patches()


class TitoWorkerExtension(BroadcastWorker, DeltaWorker, ArealWorker):
    """What vLLM mixes into its Worker: checkpoint reload here, the trainer's broadcast (worker_broadcast.py), staged
    deltas (worker_delta.py), AReaL's per-tensor updates (worker_areal.py)."""

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
        before = self._tito_digests_before()
        vllm_patches_weights.last_tie_seconds = 0.0
        t0 = time.perf_counter()
        try:
            self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
        except BaseException:
            self._tito_abandon_reload()
            raise
        t1 = time.perf_counter()
        if report.failed:
            raise RuntimeError(f"layer(s) failed to load: {'; '.join(report.failed[:8])}")
        # reload_seconds: vLLM's reload (reading the tensors included), what tito adds is measured against it;
        # retie_seconds, inside it: a tied head given the embedding's new kernel (vLLM's own reload leaves the head
        # on the old weights: fix 8 of app/engine/vllm_patches.py).
        after = self._tito_digests_after()
        return {"kept": dict(report.kept), "rotary_before": _digest_of(before), "not_loaded": sorted(report.not_loaded),
                "rotary_after": _digest_of(after), "reload_seconds": t1 - t0,
                "retie_seconds": vllm_patches_weights.last_tie_seconds}

    # The rotary caches as the last digest saw them: (their identities, a copy of each, their digests).
    _tito_digests: tuple[dict[str, tuple[int, int]], dict[str, Any], dict[str, str]] | None = None

    def _tito_digests_before(self) -> dict[str, str]:
        """The rotary caches' digests before a reload: the last reload's "after" when each cache is still the same
        tensor at the same address (nothing between two updates writes them: hashing them again under the pause
        would only cost time), else computed now."""
        held = self._tito_digests
        if held is not None and held[0] == self._tito_buffer_ids():
            return held[2]
        return self.tito_buffer_digests()

    def _tito_digests_after(self) -> dict[str, str]:
        """The digests after a reload: the kept ones when every cache is still bit for bit the copy they were taken
        from (a compare costs a fraction of a hash: this is under the pause), else hashed again."""
        import torch

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        bufs = {name: buf for name, buf in model.named_buffers() if "rotary" in name}
        held = self._tito_digests
        if held is not None and set(held[1]) == set(bufs) and all(
                _bits(b).shape == _bits(held[1][n]).shape and bool(torch.equal(_bits(b), _bits(held[1][n])))
                for n, b in bufs.items()):
            after = held[2]
        else:
            after = self.tito_buffer_digests()
        self._tito_digests = (self._tito_buffer_ids(), {n: b.detach().clone() for n, b in bufs.items()}
                              if held is None or after is not held[2] else held[1], after)
        return after

    def _tito_buffer_ids(self, contains: str = "rotary") -> dict[str, tuple[int, int]]:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {name: (id(buf), buf.data_ptr()) for name, buf in model.named_buffers() if contains in name}

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
                raw = t.reshape(-1).view(torch.uint8).numpy()  # hashed in place, no copy
                out[name] = f"{t.dtype}:{list(t.shape)}:{hashlib.sha256(raw).hexdigest()}"
        return out

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


def _bits(t: Any) -> Any:
    """A tensor's raw bits as integers of its element size (bitwise equality: no NaN or signed-zero surprises)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(-1).view(ints)


def _digest_of(digests: dict[str, str]) -> str:
    """One short digest over named buffer digests (order-independent)."""
    import hashlib

    return hashlib.sha256("\n".join(f"{k}={v}" for k, v in sorted(digests.items())).encode()).hexdigest()[:16]


def benign_layer_classes(model: Any) -> set[str]:
    """Class names all of whose instances in ``model`` hold no parameter and only non-checkpoint buffers, or only
    parameters another module holds too (a tied head: its tensor loads through the embedding, and the checkpoint's
    copy of it is skipped, app/weights/tied.py)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    verdict: dict[str, bool] = {}
    for module in model.modules():
        params = [p for p in module._parameters.values() if p is not None]
        buffers = [n for n, b in module._buffers.items() if b is not None]
        ok = not params and bool(buffers) and all(b in NON_CHECKPOINT_BUFFERS for b in buffers)
        ok = ok or (is_tied_head(module) and bool(params) and all(owners[id(p)] > 1 for p in params))
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
