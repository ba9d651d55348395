"""Applying a staged sparse delta inside vLLM's workers (mixed into ``app.engine.worker.TitoWorkerExtension``).

Each worker keeps a **copy** of the active weights it cannot read back from the model, in host memory, in Hugging
Face names and the checkpoint's own dtypes (``tito_delta_prepare`` fills it from the active checkpoint in a background
thread while the engine keeps generating): the tensors whose loaded form processing replaced (on CPU every linear
layer's weight, re-packed for oneDNN and dropped). A tensor the kernel reads as loaded ("in place": a norm, an
embedding, on CUDA every unquantized layer) is read from the model itself. A commit (``tito_delta_commit``, under the
pause) then:

1. writes each in-place tensor's changed elements straight into its parameter, the delta added to the live value
   (in the wider dtype, rounded once: the trainer's target bit for bit), at the positions vLLM's own weight loader
   puts them (found once by running that loader on an index tensor, so fusing, tensor-parallel sharding and vocab
   padding come out right);
2. adds the other tensors' deltas to the copy and reloads their layers through vLLM's layerwise reload, fed from the
   copy (no disk read): vLLM re-runs that layer's processing (on CPU: the oneDNN re-pack).

Where in place is exact (``inplace_ok``, read from vLLM 0.32's source): norms everywhere (their forward reads the
weight); on CUDA also unquantized linear layers and embeddings (processing after loading is a no-op there); on CPU
the input embedding, whose lookup reads the weight (a tied LM head multiplies with the embedding's packed copy: that
kernel is rebuilt from the new values). On CPU every linear layer and an untied LM head are re-packed for oneDNN when
loaded (``dispatch_cpu_unquantized_gemm`` drops the weight and keeps a packed copy), so an edit of ``param.data``
would never reach the kernel: those are made ready before the pause instead (app/engine/worker_prebuild.py: a stage
hands the workers its delta, a background thread adds it to the copy and runs vLLM's processing on shadows of the
touched layers, and builds a tied head's kernel from the embedding's target; the commit swaps the processed state
in), else reloaded.

The copy costs the linear layers' weights in host memory per worker on CPU (0.88 of the 1.19 GB checkpoint at
Qwen3-0.6B's shape, 7.3 of 8.0 GB at 4B's), nothing on CUDA; any other load (disk, broadcast) drops it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from app.engine.delta_copy import DeltaCache, available_bytes, fill, give_back_memory, group_of, memory_to_spare
from app.engine.vllm_patches_weights import tie_heads
from app.engine.weight_layout import (
    Write,
    inplace_ok,
    locate,
    prepare_write,
    shared_params,
    trace_param,
)
from app.engine.weight_markers import UNTOUCHED, inject_fault
from app.engine.worker_prebuild import Pending, Prebuilt, kernel_of, prebuild_ok, swap_in, timed_build

log = logging.getLogger("tito.worker.delta")

class DeltaWorker:
    """The worker's side of staged delta updates; methods are reached with ``collective_rpc``."""

    _tito_delta: DeltaCache | None = None

    def _delta_cache(self) -> DeltaCache:
        if self._tito_delta is None:
            self._tito_delta = DeltaCache()
        return self._tito_delta

    def tito_delta_reset(self) -> bool:
        """Drop the cached copy (another load replaced the weights it mirrors)."""
        c, self._tito_delta = self._tito_delta, None
        if c is not None:
            c.cancelled = True
            if c.pending is not None:
                c.pending.cancelled = True
            give_back_memory()
        return c is not None and bool(c.shapes)

    def tito_delta_status(self) -> dict[str, Any]:
        return self._delta_cache().status()

    def tito_delta_prepare(self, version: str, files: list[str] | None, delta: dict[str, str] | None = None,
                           copy_dir: str | None = None) -> dict[str, Any]:
        """Make sure the cached copy holds ``version``: already there, being filled, or start filling it from
        ``files`` (the active checkpoint) in a background thread. ``files`` None: the copy must already be at
        ``version`` (the result of an earlier delta commit). ``delta`` ({"path", "version"}: a staged delta on
        ``version``): make it ready for its commit in the background too (worker_prebuild.py). ``copy_dir``: the
        copy is a memory-mapped file there instead of anonymous memory (``--delta-copy file``)."""
        c = self._delta_cache()
        if not (c.version == version and (c.ready or (c.thread is not None and c.thread.is_alive()))):
            if files is None:
                return {**c.status(), "state": "missing"}
            self.tito_delta_reset()
            c = self._tito_delta = DeltaCache(version=version)
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            c.thread = threading.Thread(target=fill, args=(c, list(files), copy_dir, model,
                                                           self.vllm_config),  # type: ignore[attr-defined]
                                        name="tito-delta-fill", daemon=True)
            c.thread.start()
        old = c.pending
        if delta is not None and not (old is not None and not old.cancelled and old.state != "error" and
                                      (old.version, old.path, old.base) == (delta["version"], delta["path"], version)):
            p = c.pending = Pending(delta["version"], version, delta["path"])
            p.thread = threading.Thread(target=self._delta_ready, args=(c, p, old), name="tito-delta-ready",
                                        daemon=True)
            p.thread.start()
        return c.status()

    def tito_delta_trace(self, shapes: dict[str, list[int]]) -> dict[str, Any]:
        """Where each element of these HF tensors lands in vLLM's parameters (fused, sharded), as the in-place path
        maps it: ``{name: {"param", "shard", "runs": [[hf_start, param_start, length], ...]}}`` (None: no such
        module). Traces the parameter as the loader first saw it (vLLM's reload metadata), so it also answers for
        parameters a platform re-packed (CPU linears): a check of the mapping CUDA's in-place path uses."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        packed = dict(getattr(model, "packed_modules_mapping", None) or {})
        quantized = getattr(self.vllm_config, "quant_config", None) is not None  # type: ignore[attr-defined]
        out: dict[str, Any] = {}
        for name, shape in shapes.items():
            where = locate(model, name, packed)
            if where is None:
                out[name] = None
                continue
            module, pname, shard, vname = where
            param = get_layerwise_info(module).restore_metadata[0].get(pname, module._parameters.get(pname))
            plan = trace_param(param, shard, tuple(shape), module)
            out[name] = {"param": vname, "shard": shard, "shape": list(param.shape),
                         "inplace": not quantized and inplace_ok(module), "runs": None if plan is None
                         else [[int(a), int(b), int(n)] for a, b, n in zip(plan.hf_start, plan.p_start, plan.length,
                                                                           strict=True)]}
        return out

    def tito_delta_commit(self, path: str, base: str, version: str, wait: float = 600.0) -> dict[str, Any]:
        """Apply the prepared delta at ``path`` (app/engine/delta_format.py, int64 indices) on top of cached ``base``;
        the cache then holds ``version``. Errors before anything changed carry ``UNTOUCHED``."""
        c = self._delta_cache()
        if c.thread is not None and c.version == base:
            c.thread.join(wait)  # a commit right after the first stage: the copy may still be filling
        p = c.pending
        if p is not None and not p.cancelled and (p.version, p.path, p.base) == (version, path, base):
            if p.thread is not None:
                p.thread.join(wait)  # under the pause the engine is idle: the rest of the preparation runs at once
            if p.state == "ready":
                return self._delta_commit_ready(c, p)
            log.warning("delta %s was not made ready (%s): applying it under the pause", version, p.error or p.state)
        if p is not None:
            self._delta_discard(c, p, wait)
        if not c.ready or c.version != base:
            why = c.error or (f"it holds {c.version!r}" if c.version else "it is empty")
            raise ValueError(f"{UNTOUCHED}the worker's copy of version {base!r} is not available ({why}); "
                             "stage the delta again")
        t0 = time.perf_counter()
        _check_records(c, Path(path))  # nothing changes yet: every record must fit the cached tensors
        # Into the copy (the model unchanged): a failure here leaves the served weights intact.
        cpu0 = time.thread_time()
        try:
            inplace, touched, elements = self._delta_to_copy(c, Path(path))
        except Exception as e:  # noqa: BLE001 - re-raised as an untouched failure
            self.tito_delta_reset()
            raise RuntimeError(f"{UNTOUCHED}adding the delta to the worker's copy failed ({type(e).__name__}: "
                               f"{e}); the model is unchanged") from None
        t_copy = time.perf_counter() - t0
        # Into the model: from here a failure leaves a mix of versions (the server marks it inconsistent).
        try:
            out = self._delta_to_model(c, inplace, touched)
        except BaseException:
            self.tito_delta_reset()  # the copy may be ahead of the model: a later delta must refill it
            raise
        c.version = version
        give_back_memory()
        return {"pid": os.getpid(), "seconds": time.perf_counter() - t0, "copy_seconds": t_copy,
                "cpu_seconds": time.thread_time() - cpu0, "tensors": len(inplace) + len(touched),
                "elements": elements, "prepared": False, **out}

    def _delta_commit_ready(self, c: DeltaCache, p: Pending) -> dict[str, Any]:
        """The commit of a delta made ready before the pause: the copy already holds it, the touched linear layers
        are processed; write the in-place elements, swap the processed layers in, reload what is left."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            out = self._delta_to_model(c, p.inplace, p.reload, p.prebuilt)
        except BaseException:
            self.tito_delta_reset()
            raise
        c.version, c.pending = p.version, None
        give_back_memory()  # the replaced layers' packed weights
        return {"pid": os.getpid(), "seconds": time.perf_counter() - t0, "copy_seconds": 0.0,
                "cpu_seconds": time.thread_time() - cpu0, "tensors": p.tensors, "elements": p.elements,
                "prepared": True, "prepare_seconds": round(p.seconds, 3), **out}

    def _delta_discard(self, c: DeltaCache, p: Pending, wait: float) -> None:
        """Forget a delta made ready for another commit: the copy goes back to its base."""
        p.cancelled = True
        if p.thread is not None:
            p.thread.join(wait)
            if p.thread.is_alive():
                self.tito_delta_reset()
                raise RuntimeError(f"{UNTOUCHED}the preparation of delta {p.version} did not stop within {wait:g}s; "
                                   "the worker's copy was dropped: stage the delta again")
        undo(c, p)
        if c.pending is p:
            c.pending = None
        give_back_memory()  # its processed layers

    def _delta_ready(self, c: DeltaCache, p: Pending, old: Pending | None) -> None:
        """Background thread, beside generation at its priority: add the delta to the copy (undoably), then process a
        shadow of each touched layer that allows it (worker_prebuild.py), and build a tied head's kernel from the
        embedding's target. Touches no live tensor."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            if old is not None:  # the delta staged before on this copy: take it back out first
                old.cancelled = True
                if old.thread is not None:
                    old.thread.join()
                undo(c, old)
            if c.thread is not None:
                c.thread.join()
            if not c.ready:
                raise RuntimeError(c.error or "the copy of the active weights is not available")
            _check_records(c, Path(p.path))
            p.inplace, touched, p.elements = self._delta_to_copy(c, Path(p.path), p)
            p.tensors = len(p.undo) + len(p.inplace)
            p.copy_seconds = time.perf_counter() - t0
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            shared = shared_params(model)
            for module_path, kernel in self._kernels_ahead(c, p.inplace, shared).items():
                p.prebuilt[module_path] = kernel
            quantized = getattr(self.vllm_config, "quant_config", None) is not None  # type: ignore[attr-defined]
            members: dict[str, list[str]] = {}
            for name, (module_path, _, _) in c.where.items():
                members.setdefault(module_path, []).append(name)
            for module_path in sorted({c.where[n][0] for n in touched if n in c.where}):
                if p.cancelled:
                    break
                feeds = [(c.where[n][1], c.where[n][2], c.tensors[n]) for n in members[module_path]]
                if not memory_to_spare(3 * sum(t.numel() * t.element_size() for _, _, t in feeds)):
                    # Each layer processed ahead holds a second (packed) copy of its weights until the commit, and
                    # its processing a scratch one for a moment: the rest reload under the pause rather than the
                    # worker running out of memory (at Qwen3-4B's shape on a 24 GB host all of them would not fit
                    # beside the served ones).
                    log.warning("delta %s: %d layers processed ahead, then the host's memory ran short (%.1f GB "
                                "available): the other touched layers reload at commit", p.version,
                                len(p.prebuilt), available_bytes() / 1e9)
                    break
                module = model.get_submodule(module_path)
                if not prebuild_ok(module, shared, quantized):
                    continue
                built = timed_build(module_path, module, feeds)
                if built is not None:
                    p.prebuilt[module_path] = built
            p.reload = {n for n in touched if c.where.get(n, ("", "", None))[0] not in p.prebuilt}
            if p.cancelled:
                p.state = "cancelled"
                undo(c, p)
            else:
                p.state = "ready"
                log.info("delta %s ready for its commit in %.2fs (copy %.2fs): %d layers processed ahead, %d tensors "
                         "left to reload", p.version, time.perf_counter() - t0, p.copy_seconds, len(p.prebuilt),
                         len(p.reload))
        except Exception as e:  # noqa: BLE001 - reported by tito_delta_status; the commit applies it the old way
            p.error, p.state = f"{type(e).__name__}: {e}", "error"
            undo(c, p)
            log.warning("delta %s: preparing it before the pause failed (%s); its commit applies it under the pause",
                        p.version, p.error)
        finally:
            p.seconds, p.cpu_seconds = time.perf_counter() - t0, time.thread_time() - cpu0

    def _kernels_ahead(self, c: DeltaCache, writes: list[Write], shared: set[int]) -> dict[str, Prebuilt]:
        """For each tensor written in place whose weight a tied head multiplies with (on CPU, through a kernel
        packed from it): that kernel built from the target (the live weight with the delta's writes, in a scratch
        copy)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        out: dict[str, Prebuilt] = {}
        for w in writes:
            module_path, pname, _ = c.where[w.name]
            module = model.get_submodule(module_path)
            if (id(module._parameters.get(pname)) not in shared or not kernel_of(module)
                    or not memory_to_spare(3 * w.param.numel() * w.param.element_size())):
                continue
            target = w.param.detach().clone()
            w.apply(into=target)
            built = timed_build(module_path, module, [], {pname: target})
            if built is not None:
                out[module_path] = built
        return out

    def _delta_to_copy(self, c: DeltaCache, path: Path,
                       p: Pending | None = None) -> tuple[list[Write], set[str], int]:
        """Add every record of a tensor the commit does not write in place to the copy; return the in-place
        tensors' writes (worked out now against the live weights, scattered into them at commit), the other touched
        tensors, and the number of changed elements. With ``p`` (a delta made ready before the pause): undoably (the
        replaced elements go to ``p.undo``), stopping when ``p`` is cancelled."""
        from app.engine.delta_format import apply_to, iter_stream

        inplace: list[Write] = []
        touched: set[str] = set()
        elements = 0
        for rec in iter_stream(path):
            if p is not None and p.cancelled:
                break
            elements += rec.indices.numel()
            plan = c.plans.get(rec.name)
            if plan is not None:
                inplace.append(prepare_write(plan, rec))
                continue
            flat = c.tensors[rec.name].view(-1)
            if p is None:
                apply_to(flat, rec)
            else:
                p.undo.append((rec.name, rec.indices, apply_undoable(flat, rec)))
            if rec.indices.numel():
                touched.add(rec.name)
        return inplace, touched, elements

    def _delta_to_model(self, c: DeltaCache, inplace: list[Write], touched: set[str],
                        prebuilt: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write the in-place tensors' changed elements, swap in the layers (and a tied head's kernel) processed
        ahead, then reload the other touched layers from the copy."""
        t0 = time.perf_counter()
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        prebuilt = prebuilt or {}
        whole = {(path, name) for path, b in prebuilt.items() for name in b.storage}  # swapped in, not written
        written: set[str] = set()
        for w in inplace:
            where = c.where[w.name]
            if (where[0], where[1]) not in whole:
                w.apply()
            if w.pos.numel():
                written.add(where[0])
        t_inplace = time.perf_counter() - t0
        if prebuilt:  # (the test-only fault hook counts swapped layers as it counts loaded tensors)
            for _, layer in inject_fault(prebuilt.items()):
                swap_in(layer)
        # A tied embedding written in place without its kernel built ahead: packed again now, from the new values.
        shared = shared_params(model)
        for module_path in sorted(written - set(prebuilt)):
            module = model.get_submodule(module_path)
            if kernel_of(module) and id(getattr(module, "weight", None)) in shared:
                module.quant_method.process_weights_after_loading(module)
        retie_s = tie_heads(model) if written else 0.0
        t_swap = time.perf_counter() - t0 - t_inplace
        packed = dict(getattr(self.model_runner.get_model(), "packed_modules_mapping", None) or {})  # type: ignore[attr-defined]
        groups = sorted({group_of(n, packed) for n in touched})
        feed = [n for g in groups for n in c.groups[g]
                if c.plans.get(n) is None and c.where.get(n, ("", "", None))[0] not in prebuilt]
        reload_s = 0.0
        if feed:
            expect = {c.vllm_names[n] for n in feed if n in c.vllm_names}
            items = inject_fault((n, c.tensors[n]) for n in feed)
            out = self._tito_reload(items, partial=True)  # type: ignore[attr-defined]
            missed = sorted(expect & set(out["not_loaded"]))
            if missed:
                raise RuntimeError(f"weight(s) of the delta's layers did not load: {', '.join(missed[:8])}")
            reload_s, retie_s = float(out["reload_seconds"]), retie_s + float(out.get("retie_seconds", 0.0))
        elif inplace or prebuilt:
            self._tito_weights_changed()
        return {"inplace": len(inplace), "inplace_seconds": t_inplace, "prebuilt": len(prebuilt),
                "swap_seconds": t_swap, "reload_seconds": reload_s, "retie_seconds": retie_s,
                "reloaded_groups": len({group_of(n, packed) for n in feed}), "reloaded_tensors": len(feed)}

    def _tito_weights_changed(self) -> None:
        """What vLLM's ``reload_weights`` does after loading (caches computed with the old weights go), for a commit
        that changed the weights without it."""
        runner = self.model_runner  # type: ignore[attr-defined]
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(runner, reset, None)
            if fn is not None:
                fn()


def _check_records(c: DeltaCache, path: Path) -> None:
    """Every record of the prepared delta fits the cached tensors (names, shapes), else an untouched failure."""
    from app.engine.delta_format import DeltaFormatError, iter_stream

    try:
        for rec in iter_stream(path, headers_only=True):
            held = c.shapes.get(rec.name)
            if held is None or tuple(held) != tuple(rec.shape):
                raise DeltaFormatError(f"{rec.name!r} does not match the cached weights")
    except (DeltaFormatError, OSError) as e:
        raise ValueError(f"{UNTOUCHED}prepared delta {path} is unreadable: {e}") from None


def apply_undoable(flat: Any, rec: Any) -> Any:
    """``apply_to`` that returns the elements it replaced (to put them back with ``undo``)."""
    from app.engine.delta_format import apply_to, gather

    old = gather(flat, rec.indices).clone() if rec.indices.numel() else rec.indices.new_empty(0)
    apply_to(flat, rec)
    return old


def undo(c: DeltaCache, p: Pending) -> None:
    """Put back what a made-ready delta changed in the copy (the model never saw it); forget its layers."""
    from app.engine.delta_format import scatter

    for name, idx, old in reversed(p.undo):
        if idx.numel() and name in c.tensors:
            scatter(c.tensors[name].view(-1), idx, old)
    p.undo.clear()
    p.prebuilt.clear()
