"""A staged delta made ready before the pause, inside vLLM's workers (used by app/engine/worker_delta.py).

On CPU every linear layer's weight is re-packed for oneDNN after it is loaded (vLLM 0.32:
``UnquantizedLinearMethod.process_weights_after_loading`` -> ``dispatch_cpu_unquantized_gemm``), so loading a changed
layer costs about as much as loading it from a checkpoint: a commit that reloads every touched layer under the pause
is nearly as long as a full update. Here that work moves out of the pause:

- while the engine generates, a background thread adds the delta to the workers' cached copy (keeping the old values
  of every changed element, to undo it if another version is committed instead), then, for each touched linear
  layer, loads the target weights into a **shadow** of the layer (a shallow copy holding fresh tensors, built from
  vLLM's own reload metadata and filled by the layer's own weight loaders) and runs vLLM's own processing on it;
- under the pause, the commit puts the shadow's processed state into the live layer as vLLM's layerwise reload puts
  back a reloaded layer's (``_copy_and_restore_kernel_tensors``: values copied into the layer's own tensors, so their
  identity is kept), plus the attributes processing set (on CPU the packed kernel, ``cpu_linear``).

The result is what vLLM's reload would have produced from the same target weights (the tests compare it with a fresh
engine and with transformers). Taken for unquantized linear layers and an untied LM head on CPU; everything else keeps
the reload path, and on CUDA linear layers are written in place (worker_delta.py). An embedding a tied LM head
multiplies with is written in place at commit; its kernel (the packed copy the head uses) is built here the same way,
from the embedding's target, and only the kernel is swapped in.
"""

from __future__ import annotations

import copy
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tito.worker.delta")

# What an nn.Module keeps in its __dict__ for itself: never copied back from a shadow.
_MODULE_SLOTS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
                           "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_state_dict_hooks",
                           "_load_state_dict_pre_hooks"})


class NotPrebuildable(Exception):
    """This layer keeps the reload path (said in the log)."""


@dataclass
class Prebuilt:
    """A layer's processed state for the target weights, waiting for the commit."""

    layer: Any
    params: dict[str, Any]
    buffers: dict[str, Any]
    attrs: dict[str, Any]
    storage: dict[str, Any] = field(default_factory=dict)  # parameter name -> its new values, swapped in whole

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.params.values(), *self.buffers.values(),
                                                           *self.storage.values()])


@dataclass
class Pending:
    """One staged delta being made ready (or ready) in a worker, on top of the cached copy of ``base``."""

    version: str
    base: str
    path: str
    state: str = "preparing"  # preparing | ready | error | cancelled
    error: str | None = None
    cancelled: bool = False
    undo: list[tuple[str, Any, Any]] = field(default_factory=list)  # (name, indices, old values), in applied order
    inplace: list[Any] = field(default_factory=list)  # weight_layout.Write: in-place elements, scattered at commit
    prebuilt: dict[str, Prebuilt] = field(default_factory=dict)  # module path -> its processed state
    reload: set[str] = field(default_factory=set)  # touched HF names that still reload under the pause
    tensors: int = 0
    elements: int = 0
    copy_seconds: float = 0.0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # the preparing thread's own CPU time
    thread: threading.Thread | None = None

    def status(self) -> dict[str, Any]:
        return {"version": self.version, "base": self.base, "state": self.state, "error": self.error,
                "prebuilt": len(self.prebuilt), "reload": len(self.reload), "seconds": round(self.seconds, 3),
                "cpu_seconds": round(self.cpu_seconds, 3),
                "bytes": sum(p.nbytes for p in list(self.prebuilt.values()))}  # list(): the thread may add one


def prebuild_ok(module: Any, shared: set[int], quantized: bool) -> bool:
    """Layers whose processing after loading is vLLM 0.32's CPU re-pack of an unquantized weight: a linear layer, or
    an LM head that does not share its weight with the embedding (a tied weight is loaded through the embedding)."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.platforms import current_platform

    if quantized or not current_platform.is_cpu() or id(getattr(module, "weight", None)) in shared:
        return False
    method = type(getattr(module, "quant_method", None)).__name__
    if isinstance(module, LinearBase):
        return isinstance(module.quant_method, UnquantizedLinearMethod)
    return isinstance(module, ParallelLMHead) and method == "UnquantizedEmbeddingMethod"


def kernel_of(module: Any) -> bool:
    """Whether processing gave the module a GEMM kernel of its own (on CPU, ``dispatch_cpu_unquantized_gemm``)."""
    from app.engine.vllm_patches_weights import KERNEL_ATTRS

    return all(hasattr(module, a) for a in KERNEL_ATTRS)


def build_kernel(layer: Any, weights: dict[str, Any]) -> Prebuilt:
    """Run vLLM's processing on a shadow of ``layer`` holding ``weights`` (parameter name -> the whole target, in the
    layer's own layout): the kernel attributes processing sets, and the target itself, which the commit swaps in as
    the parameter's storage (on CPU, where nothing holds its address: one pointer, not a copy under the pause)."""
    import torch

    before = dict(layer.__dict__)
    shadow = copy.copy(layer)
    shadow._parameters = dict(layer._parameters)
    for name, t in weights.items():
        shadow._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
    with torch.no_grad():
        shadow.quant_method.process_weights_after_loading(shadow)
    attrs = {k: v for k, v in shadow.__dict__.items() if k not in _MODULE_SLOTS and before.get(k, _MISSING) is not v}
    return Prebuilt(layer, {}, {}, attrs, dict(weights))


def _fresh(meta: Any, shadow: Any) -> Any:
    """A new tensor shaped like vLLM's reload metadata ``meta``, its attributes (loaders) bound to ``shadow``."""
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

    from app.engine.weight_layout import bound_to

    t = materialize_meta_tensor(meta)  # copies meta's __dict__: the metadata itself is not changed
    for k, v in list(t.__dict__.items()):
        t.__dict__[k] = bound_to(v, shadow)
    return t


def _clone(live: Any, shadow: Any) -> Any:
    """A copy of a live tensor the metadata does not cover (vLLM never puts ``bias`` on meta), same class and
    attributes: loading into it leaves the live one alone."""
    import torch

    from app.engine.weight_layout import bound_to

    data = live.detach().clone()
    t = torch.nn.Parameter._make_subclass(type(live), data, False) if isinstance(live, torch.nn.Parameter) else data
    for k, v in live.__dict__.items():
        t.__dict__[k] = bound_to(v, shadow)
    return t


def build(layer: Any, feeds: list[tuple[str, Any, Any]]) -> Prebuilt:
    """Load ``feeds`` ((parameter name, shard id, HF tensor) covering the whole layer) into a shadow of ``layer`` with
    the layer's own loaders, run vLLM's processing on the shadow, and return what the commit puts back."""
    import torch
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import get_numel_loaded
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_size
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from app.engine.weight_layout import bound_to, unwrapped_loader

    info = get_layerwise_info(layer)
    meta_params, meta_buffers = info.restore_metadata
    if not meta_params:
        raise NotPrebuildable("vLLM recorded no reload metadata for it")
    before = dict(layer.__dict__)
    shadow = copy.copy(layer)
    shadow._parameters, shadow._buffers = dict(layer._parameters), dict(layer._buffers)
    shadow._non_persistent_buffers_set = set(layer._non_persistent_buffers_set)
    with torch.no_grad(), info.restore_device:
        for name, meta in meta_params.items():
            shadow._parameters[name] = _fresh(meta, shadow)
        for name, meta in meta_buffers.items():
            shadow._buffers[name] = _fresh(meta, shadow)
        for store, live in ((shadow._parameters, layer._parameters), (shadow._buffers, layer._buffers)):
            for name, t in live.items():
                if t is not None and name not in meta_params and name not in meta_buffers:
                    store[name] = _clone(t, shadow)
        loaded = 0
        for pname, shard, tensor in feeds:
            param = shadow._parameters[pname]
            loader = bound_to(unwrapped_loader(getattr(param, "weight_loader", default_weight_loader)), shadow)
            args = inspect.signature(loader).bind(*((param, tensor) if shard is None else (param, tensor, shard)))
            args.apply_defaults()
            n, _ = get_numel_loaded(loader, args)
            loaded += n
        want = get_layer_size(shadow)
        if loaded < want:  # a part the HF names did not cover would stay uninitialized
            raise NotPrebuildable(f"the delta's tensors load {loaded} of its {want} elements")
        if hasattr(shadow, "_already_called_process_weights_after_loading"):
            delattr(shadow, "_already_called_process_weights_after_loading")
        shadow.quant_method.process_weights_after_loading(shadow)
        if hasattr(shadow, "update_param_tp_status"):
            shadow.update_param_tp_status()
    params, buffers = get_layer_params_buffers(shadow)
    for store, live in ((params, layer._parameters), (buffers, layer._buffers)):
        for name, t in store.items():
            have = live.get(name)
            if have is None or have.shape != t.shape or have.dtype != t.dtype:
                raise NotPrebuildable(f"processing made {name!r} {t.dtype}{list(t.shape)}, the live layer holds "
                                      f"{None if have is None else (have.dtype, list(have.shape))}")
    attrs = {k: v for k, v in shadow.__dict__.items() if k not in _MODULE_SLOTS and before.get(k, _MISSING) is not v}
    return Prebuilt(layer, params, buffers, attrs)


_MISSING = object()


def swap_in(p: Prebuilt) -> None:
    """Under the pause: the live layer takes the shadow's processed state (values into its own tensors)."""
    import torch

    with torch.no_grad():
        for name, t in p.storage.items():
            p.layer._parameters[name].data = t
        for name, t in p.params.items():
            p.layer._parameters[name].data.copy_(t)
        for name, t in p.buffers.items():
            p.layer._buffers[name].data.copy_(t)
    for k, v in p.attrs.items():
        setattr(p.layer, k, v)


def timed_build(path: str, layer: Any, feeds: list[tuple[str, Any, Any]],
                weights: dict[str, Any] | None = None) -> Prebuilt | None:
    """``build`` (``weights``: ``build_kernel``), or None (with the reason in the log) when the layer keeps the
    reload path."""
    t0 = time.perf_counter()
    try:
        out = build_kernel(layer, weights) if weights is not None else build(layer, feeds)
    except NotPrebuildable as e:
        log.info("delta: %s reloads at commit (%s)", path, e)
        return None
    log.debug("delta: %s prepared in %.3fs", path, time.perf_counter() - t0)
    return out
