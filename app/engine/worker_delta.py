"""Applying a staged sparse delta inside vLLM's workers (mixed into ``app.engine.worker.TitoWorkerExtension``).

Each worker keeps a **cached full copy** of the active weights in host memory, in Hugging Face names and the
checkpoint's own dtypes (``tito_delta_prepare`` fills it from the active checkpoint in a background thread while the
engine keeps generating). A commit (``tito_delta_commit``, under the pause) then:

1. adds each tensor's delta to the cached copy (the target tensor, exactly as the trainer has it);
2. writes the changed elements straight into the parameter where its layout allows it ("in place"): the parameter
   the kernel reads is the loaded tensor itself, at a position vLLM's own weight loader decides (found once by
   running that loader on an index tensor, so fusing, tensor-parallel sharding and vocab padding come out right);
3. reloads every other touched layer through vLLM's layerwise reload, fed from the cached copy (no disk read):
   vLLM re-runs that layer's processing (on CPU: the oneDNN re-pack), and leaves the layers it is not fed as they are.

Where in place is exact (``_inplace_ok``, read from vLLM 0.32's source): norms everywhere (their forward reads the
weight); on CUDA also unquantized linear layers and embeddings (processing after loading is a no-op there); on CPU
the input embedding unless its weight is shared (tied) with the LM head. On CPU every linear layer and the LM head
are re-packed for oneDNN when loaded (``dispatch_cpu_unquantized_gemm`` drops the weight and keeps a packed copy),
so an edit of ``param.data`` would never reach the kernel: those go through the reload.

The copy costs one checkpoint's worth of host memory per worker; any other load (disk, broadcast) drops it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.engine.weight_markers import BUFFER_SUFFIXES, UNTOUCHED, inject_fault

log = logging.getLogger("tito.worker.delta")


@dataclass
class InPlace:
    """Where one HF tensor's elements live in a vLLM parameter: runs of consecutive elements, sorted by HF index."""

    param: Any  # the live torch parameter
    hf_start: Any  # int64 tensors, one entry per run
    p_start: Any
    length: Any


@dataclass
class DeltaCache:
    version: str | None = None
    tensors: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    error: str | None = None
    cancelled: bool = False  # dropped while filling: the fill stops
    thread: threading.Thread | None = None
    seconds: float = 0.0
    plans: dict[str, InPlace | None] = field(default_factory=dict)  # HF name -> in place, or None: reload its group
    groups: dict[str, list[str]] = field(default_factory=dict)  # group -> its HF names (they reload together)
    vllm_names: dict[str, str] = field(default_factory=dict)  # HF name -> vLLM parameter name (fused), when known

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def status(self) -> dict[str, Any]:
        state = "ready" if self.ready else "error" if self.error else "filling" if self.thread else "empty"
        return {"pid": os.getpid(), "version": self.version, "state": state, "error": self.error,
                "tensors": len(self.tensors), "bytes": self.nbytes if self.ready else 0,
                "inplace": sum(p is not None for p in self.plans.values()), "seconds": round(self.seconds, 3)}


def group_of(name: str, packed: dict[str, list[str]]) -> str:
    """The tensors that vLLM may fuse into one layer reload together: everything under a numbered block
    (``model.layers.3``), else the parent of a packed projection, else the module itself."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    module = ".".join(parts[:-1])
    if len(parts) > 2 and any(parts[-2] in v for v in packed.values()):
        return ".".join(parts[:-2])
    return module


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
        return c is not None and bool(c.tensors)

    def tito_delta_status(self) -> dict[str, Any]:
        return self._delta_cache().status()

    def tito_delta_prepare(self, version: str, files: list[str] | None) -> dict[str, Any]:
        """Make sure the cached copy holds ``version``: already there, being filled, or start filling it from
        ``files`` (the active checkpoint) in a background thread. ``files`` None: the copy must already be at
        ``version`` (the result of an earlier delta commit)."""
        c = self._delta_cache()
        if c.version == version and (c.ready or (c.thread is not None and c.thread.is_alive())):
            return c.status()
        if files is None:
            return {**c.status(), "state": "missing"}
        self.tito_delta_reset()
        c = self._tito_delta = DeltaCache(version=version)
        c.thread = threading.Thread(target=self._delta_fill, args=(c, list(files)), name="tito-delta-fill",
                                    daemon=True)
        c.thread.start()
        return c.status()

    def _delta_fill(self, c: DeltaCache, files: list[str]) -> None:
        """Read the checkpoint into host memory (a real copy: the files may be replaced or deleted later), then work
        out which tensors can be written in place. Runs beside generation; touches no live tensor."""
        from safetensors import safe_open

        t0 = time.perf_counter()
        try:
            tensors: dict[str, Any] = {}
            for f in files:
                with safe_open(f, framework="pt") as st:
                    for name in st.keys():
                        if c.cancelled:
                            return
                        if not name.endswith(BUFFER_SUFFIXES):
                            tensors[name] = st.get_tensor(name).clone()
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            packed = dict(getattr(model, "packed_modules_mapping", None) or {})
            groups: dict[str, list[str]] = {}
            for name in tensors:
                groups.setdefault(group_of(name, packed), []).append(name)
            plans, vnames = _plans(model, self.vllm_config, tensors, packed)  # type: ignore[attr-defined]
            c.tensors, c.groups, c.plans, c.vllm_names = tensors, groups, plans, vnames
            c.seconds = time.perf_counter() - t0
            c.ready = True
            log.info("delta cache: version %s, %d tensors (%.0f MB) in %.2fs; %d written in place on commit",
                     c.version, len(tensors), c.nbytes / 1e6, c.seconds, sum(p is not None for p in plans.values()))
        except Exception as e:  # noqa: BLE001 - reported by tito_delta_status / the commit
            c.error = f"{type(e).__name__}: {e}"
            c.tensors = {}
            log.error("delta cache fill failed: %s", c.error)

    def tito_delta_trace(self, shapes: dict[str, list[int]]) -> dict[str, Any]:
        """Where each element of these HF tensors lands in vLLM's parameters (fused, sharded), as the in-place path
        maps it: ``{name: {"param", "shard", "runs": [[hf_start, param_start, length], ...]}}`` (None: no such
        module). Traces the parameter as the loader first saw it (vLLM's reload metadata), so it also answers for
        parameters a platform re-packed (CPU linears): a check of the mapping CUDA's in-place path uses."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        packed = dict(getattr(model, "packed_modules_mapping", None) or {})
        shared = _shared_params(model)
        quantized = getattr(self.vllm_config, "quant_config", None) is not None  # type: ignore[attr-defined]
        out: dict[str, Any] = {}
        for name, shape in shapes.items():
            where = _locate(model, name, packed)
            if where is None:
                out[name] = None
                continue
            module, pname, shard, vname = where
            param = get_layerwise_info(module).restore_metadata[0].get(pname, module._parameters.get(pname))
            plan = _trace(param, shard, tuple(shape), module)
            out[name] = {"param": vname, "shard": shard, "shape": list(param.shape),
                         "inplace": not quantized and _inplace_ok(module, shared), "runs": None if plan is None
                         else [[int(a), int(b), int(n)] for a, b, n in zip(plan.hf_start, plan.p_start, plan.length,
                                                                           strict=True)]}
        return out

    def tito_delta_commit(self, path: str, base: str, version: str, wait: float = 600.0) -> dict[str, Any]:
        """Apply the prepared delta at ``path`` (app/engine/delta_format.py, int64 indices) on top of cached ``base``;
        the cache then holds ``version``. Errors before anything changed carry ``UNTOUCHED``."""
        from app.engine.delta_format import DeltaFormatError, iter_stream

        c = self._delta_cache()
        if c.thread is not None and c.version == base:
            c.thread.join(wait)  # a commit right after the first stage: the copy may still be filling
        if not c.ready or c.version != base:
            why = c.error or (f"it holds {c.version!r}" if c.version else "it is empty")
            raise ValueError(f"{UNTOUCHED}the worker's copy of version {base!r} is not available ({why}); "
                             "stage the delta again")
        t0 = time.perf_counter()
        # First pass, nothing changes yet: every record must fit the cached tensors.
        try:
            for rec in iter_stream(Path(path), headers_only=True):
                held = c.tensors.get(rec.name)
                if held is None or tuple(held.shape) != tuple(rec.shape):
                    raise DeltaFormatError(f"{rec.name!r} does not match the cached weights")
        except (DeltaFormatError, OSError) as e:
            raise ValueError(f"{UNTOUCHED}prepared delta {path} is unreadable: {e}") from None
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
        return {"pid": os.getpid(), "seconds": time.perf_counter() - t0, "copy_seconds": t_copy,
                "cpu_seconds": time.thread_time() - cpu0, "tensors": len(inplace) + len(touched),
                "elements": elements, **out}

    def _delta_to_copy(self, c: DeltaCache, path: Path) -> tuple[list[tuple[str, Any]], set[str], int]:
        """Add every record to the cached tensors; return the in-place tensors with their changed indices, the
        other touched tensors, and the number of changed elements."""
        from app.engine.delta_format import apply_to, iter_stream

        inplace: list[tuple[str, Any]] = []
        touched: set[str] = set()
        elements = 0
        for rec in iter_stream(path):
            apply_to(c.tensors[rec.name].view(-1), rec)
            elements += rec.indices.numel()
            if c.plans.get(rec.name) is not None:
                inplace.append((rec.name, rec.indices))
            elif rec.indices.numel():
                touched.add(rec.name)
        return inplace, touched, elements

    def _delta_to_model(self, c: DeltaCache, inplace: list[tuple[str, Any]], touched: set[str]) -> dict[str, Any]:
        """Write the in-place tensors' changed elements, then reload the touched layers from the copy."""
        t0 = time.perf_counter()
        for name, idx in inplace:
            plan = c.plans[name]
            assert plan is not None
            _write_inplace(plan, idx, c.tensors[name].view(-1))
        t_inplace = time.perf_counter() - t0
        packed = dict(getattr(self.model_runner.get_model(), "packed_modules_mapping", None) or {})  # type: ignore[attr-defined]
        groups = sorted({group_of(n, packed) for n in touched})
        feed = [n for g in groups for n in c.groups[g] if c.plans.get(n) is None]
        reload_s = 0.0
        if feed:
            expect = {c.vllm_names[n] for n in feed if n in c.vllm_names}
            items = inject_fault((n, c.tensors[n]) for n in feed)
            out = self._tito_reload(items, partial=True)  # type: ignore[attr-defined]
            missed = sorted(expect & set(out["not_loaded"]))
            if missed:
                raise RuntimeError(f"weight(s) of the delta's layers did not load: {', '.join(missed[:8])}")
            reload_s = float(out["reload_seconds"])
        return {"inplace": len(inplace), "inplace_seconds": t_inplace, "reload_seconds": reload_s,
                "reloaded_groups": len(groups), "reloaded_tensors": len(feed)}


# ------------------------------------------------------------------------------------------ in place


def _write_inplace(plan: InPlace, hf_idx: Any, target_flat: Any) -> None:
    """``param[p(i)] = target[i]`` in the parameter's dtype: what loading the target would have put there."""
    import torch

    from app.engine.delta_format import gather, scatter

    if hf_idx.numel() == 0 or plan.hf_start.numel() == 0:
        return
    j = torch.searchsorted(plan.hf_start, hf_idx, right=True) - 1
    ok = j >= 0
    j = j.clamp(min=0)
    off = hf_idx - plan.hf_start[j]
    ok &= off < plan.length[j]  # elements another tensor-parallel rank holds are skipped
    dst = plan.param.data.view(-1)
    pos = (plan.p_start[j] + off)[ok]
    scatter(dst, pos, gather(target_flat, hf_idx[ok]).to(dst.dtype))


def _inplace_ok(module: Any, shared: set[int]) -> bool:
    """Whether the kernel reads this module's parameters as loaded, on this platform (vLLM 0.32)."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, LayerNorm, RMSNorm
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.platforms import current_platform

    if isinstance(module, (RMSNorm, GemmaRMSNorm, LayerNorm)):
        return True
    cuda = bool(current_platform.is_cuda())
    if isinstance(module, VocabParallelEmbedding):
        if type(getattr(module, "quant_method", None)).__name__ != "UnquantizedEmbeddingMethod":
            return False
        if cuda:
            return True
        # CPU: the embedding lookup reads the weight; its packed copy serves only an LM head sharing that weight.
        return bool(current_platform.is_cpu()) and not isinstance(module, ParallelLMHead) and \
            id(getattr(module, "weight", None)) not in shared
    if isinstance(module, LinearBase):
        return cuda and isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod)
    return False


def _locate(model: Any, name: str, packed: dict[str, list[str]]) -> tuple[Any, str, Any, str] | None:
    """(module, parameter name, shard id, vLLM parameter name) of an HF tensor, with vLLM's fused projections
    (``packed_modules_mapping``) resolved; None when the model has no such module."""
    mod_path, _, pname = name.rpartition(".")
    parent, _, leaf = mod_path.rpartition(".")
    shard: Any = None
    for fused, parts in packed.items():
        if leaf in parts:
            shard = parts.index(leaf)
            mod_path = f"{parent}.{fused}" if parent else fused
            break
    try:
        module = model.get_submodule(mod_path)
    except AttributeError:
        return None
    if shard is not None and any(k.__name__ == "QKVParallelLinear" for k in type(module).__mro__):
        shard = ("q", "k", "v")[shard]
    return module, pname, shard, f"{mod_path}.{pname}"


def _plans(model: Any, vllm_config: Any, tensors: dict[str, Any],
           packed: dict[str, list[str]]) -> tuple[dict[str, InPlace | None], dict[str, str]]:
    plans: dict[str, InPlace | None] = {}
    vnames: dict[str, str] = {}
    quantized = getattr(vllm_config, "quant_config", None) is not None
    shared = _shared_params(model)
    for name, t in tensors.items():
        plans[name] = None
        where = _locate(model, name, packed)
        if where is None:
            continue
        module, pname, shard, vname = where
        vnames[name] = vname
        param = module._parameters.get(pname)
        if quantized or param is None or not param.is_contiguous() or not _inplace_ok(module, shared):
            continue
        try:
            plans[name] = _trace(param, shard, tuple(t.shape), module)
        except Exception as e:  # noqa: BLE001 - an unusual loader: that tensor reloads instead
            log.info("delta: %s is reloaded, not written in place (tracing its loader failed: %s)", name, e)
    return plans, vnames


def _unwrapped(loader: Any) -> Any:
    """The loader under vLLM's layerwise-reload wrapper (which, between reloads, loads nothing)."""
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def _bound(value: Any, module: Any) -> Any:
    """A method vLLM's reload metadata keeps unbound from its layer (bound to a sentinel), bound to it again."""
    from types import MethodType

    import torch

    if module is not None and isinstance(value, MethodType) and not isinstance(value.__self__, torch.nn.Module):
        return value.__func__.__get__(module)
    return value


def _shared_params(model: Any) -> set[int]:
    """ids of parameters held by more than one module (a tied LM head and embedding)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def _trace(param: Any, shard: Any, hf_shape: tuple[int, ...], module: Any = None) -> InPlace | None:
    """Run the parameter's own weight loader on an index tensor (HF element i holds i+1; 0 is what loaders fill
    padding with) into a scratch copy of the parameter (same class and attributes: vLLM's v2 loaders call methods
    of the parameter), and read back where each HF element landed."""
    import torch

    n, m = math.prod(hf_shape), param.numel()
    itype = torch.int32 if max(n, m) < 2**31 - 1 else torch.int64
    marker = torch.arange(1, n + 1, dtype=itype).view(hf_shape)
    data = torch.full(tuple(param.shape), -1, dtype=itype)
    scratch = torch.nn.Parameter._make_subclass(type(param), data, False) \
        if isinstance(param, torch.nn.Parameter) else data
    for k, v in param.__dict__.items():
        scratch.__dict__[k] = _bound(v, module)
    loader = _bound(_unwrapped(getattr(param, "weight_loader", None)), module)
    if loader is None:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        loader = default_weight_loader
    loader(scratch, marker) if shard is None else loader(scratch, marker, shard)
    scratch = scratch.data
    flat = scratch.view(-1)
    pos = torch.nonzero(flat > 0).view(-1)
    hf = flat[pos].to(torch.int64) - 1
    if pos.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return InPlace(param, empty, empty, empty)
    brk = torch.ones(pos.numel(), dtype=torch.bool)
    brk[1:] = (torch.diff(hf) != 1) | (torch.diff(pos) != 1)
    starts = torch.nonzero(brk).view(-1)
    length = torch.diff(starts, append=torch.tensor([pos.numel()]))
    hf_start, p_start = hf[starts], pos[starts]
    order = torch.argsort(hf_start)
    hf_start, p_start, length = hf_start[order], p_start[order], length[order]
    if bool((hf_start[1:] < hf_start[:-1] + length[:-1]).any()):
        return None  # an HF element placed twice: not a plain placement
    return InPlace(param, hf_start, p_start, length)
