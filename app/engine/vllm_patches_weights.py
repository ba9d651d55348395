"""tito's fix to vLLM's weight loading on CPU (8 of app/engine/vllm_patches.py, which describes it and applies it
from ``install()``): a tied LM head shares the embedding's processed GEMM instead of holding its own.

On CPU vLLM processes both halves of a tied pair after loading (``UnquantizedEmbeddingMethod``
``.process_weights_after_loading`` -> ``dispatch_cpu_unquantized_gemm``): the embedding's weight is packed for the
GEMM once for the embedding, which never multiplies with it (its forward is a lookup), and once more for the head,
which does. A load holds the packed matrix twice. A reload re-processes the embedding (its weights changed) and
leaves the head alone (it loads nothing: its weight is the embedding's), so the head keeps the GEMM handle packed
from the *old* weights and serves them. The fix: after a load and after each reload, the tied head takes the
embedding's processed kernel (the same weight, packed once, from the new values); O(1), and one packed copy fewer.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable
from typing import Any

from app.engine.vllm_patches_runner import MARK

# What a layer's CPU processing adds for its GEMM (vLLM 0.32, ``dispatch_cpu_unquantized_gemm``).
KERNEL_ATTRS = ("cpu_linear",)

last_tie_seconds = 0.0  # the last load's or reload's tie, for the update's log line
# Each model's tied pairs (its module tree does not change), and each owner's heads sharing its kernel.
_TIES: weakref.WeakKeyDictionary[Any, list[tuple[Any, str, Any, str]]] = weakref.WeakKeyDictionary()
_SHARING: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def is_tied_head(module: Any) -> bool:
    """vLLM's LM head (``ParallelLMHead``: the one layer with ``tie_weights``)."""
    return callable(getattr(module, "tie_weights", None))


def tied_heads(model: Any) -> list[tuple[Any, str, Any, str]]:
    """``(head, name, owner, owner_name)`` for each LM head parameter shared with an earlier module (a tied head
    shares the embedding's weight)."""
    first: dict[int, tuple[Any, str]] = {}
    ties = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) in first and is_tied_head(module):
                ties.append((module, name, *first[id(p)]))
            else:
                first[id(p)] = (module, name)
    return ties


def share_kernel(head: Any, owner: Any) -> bool:
    """The head takes the owner's processed GEMM when both are processed the same way (the same quant method, a
    kernel on the owner); False otherwise (the caller processes the head itself)."""
    if type(getattr(head, "quant_method", None)) is not type(getattr(owner, "quant_method", None)):
        return False
    if not all(hasattr(owner, a) for a in KERNEL_ATTRS):
        return False
    for a in KERNEL_ATTRS:
        setattr(head, a, getattr(owner, a))
    return True


def tie_heads(model: Any, ties: list[tuple[Any, str, Any, str]] | None = None) -> float:
    """Point each tied head at its owner's tensor (a reload may have put another back) and give it the owner's
    processed kernel, or process it from that tensor when the two are processed differently. Returns the seconds."""
    global last_tie_seconds
    t0 = time.perf_counter()
    if ties is None:
        ties = _TIES.get(model)
        if ties is None:
            ties = _TIES[model] = tied_heads(model)
    for head, name, owner, owner_name in ties:
        if head._parameters.get(name) is not owner._parameters.get(owner_name):
            head._parameters[name] = owner._parameters[owner_name]
        if share_kernel(head, owner):
            _SHARING.setdefault(owner, [])
            if head not in _SHARING[owner]:
                _SHARING[owner].append(head)
        else:
            method = getattr(head, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(head)
    last_tie_seconds = time.perf_counter() - t0
    return last_tie_seconds


def drop_shared_kernel(owner: Any) -> None:
    """Before ``owner`` is processed again (a reload, or a commit packing it from new values): its kernel and its
    heads' references to it go, so the old packed matrix is freed before the new one is built (the peak holds one,
    not two; the model is paused, and the tie after processing gives the heads the new one)."""
    for module in (owner, *_SHARING.get(owner, ())):
        for a in KERNEL_ATTRS:
            module.__dict__.pop(a, None)


def patch_cpu_tied_head() -> bool:
    """vLLM's reload-correctness tracker (issue 48312), for a tied LM head on the CPU platform: after the first
    load's processing and after each layerwise reload, the head shares the embedding's processed GEMM."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod as Method
    from vllm.model_executor.model_loader import base_loader
    from vllm.model_executor.model_loader.reload import inplace, layerwise

    for module, name in ((base_loader, "process_weights_after_loading"), (layerwise, "finalize_layerwise_reload"),
                         (inplace, "finalize_layerwise_reload")):
        original = getattr(module, name)
        if not getattr(original, MARK, False):
            setattr(module, name, _tying_after(original))
    if not getattr(Method.process_weights_after_loading, MARK, False):
        Method.process_weights_after_loading = _dropping_shared_first(  # type: ignore[method-assign,assignment]
            Method.process_weights_after_loading)
    return True


def _dropping_shared_first(original: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """An embedding's processing that first lets go of the kernel it shares with a tied head."""

    @functools.wraps(original)
    def process_weights_after_loading(self: Any, layer: Any) -> None:
        drop_shared_kernel(layer)
        original(self, layer)

    setattr(process_weights_after_loading, MARK, True)
    return process_weights_after_loading


def _tying_after(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original(model, ...)``, then the tied heads take the embedding's kernel."""

    @functools.wraps(original)
    def wrapper(model: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(model, *args, **kwargs)
        tie_heads(model)
        return out

    setattr(wrapper, MARK, True)
    return wrapper
