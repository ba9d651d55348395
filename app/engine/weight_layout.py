"""Where a Hugging Face tensor's elements live in vLLM's parameters (fused projections, tensor-parallel shards, vocab
padding), found by running each parameter's own weight loader on an index tensor, and which parameters the kernels
read as loaded (so a commit may write them in place). Used inside vLLM's workers by worker_delta.py and
worker_prebuild.py; read from vLLM 0.32's source.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("tito.worker.delta")


@dataclass
class InPlace:
    """Where one HF tensor's elements live in a vLLM parameter: runs of consecutive elements, sorted by HF index."""

    param: Any  # the live torch parameter
    hf_start: Any  # int64 tensors, one entry per run
    p_start: Any
    length: Any



def positions(plan: InPlace, hf_idx: Any) -> tuple[Any, Any]:
    """Where HF elements ``hf_idx`` (sorted int64) sit in the parameter, and which of them this rank holds (the
    others, held by another tensor-parallel rank, are left out)."""
    import torch

    j = torch.searchsorted(plan.hf_start, hf_idx, right=True) - 1
    ok = j >= 0
    j = j.clamp(min=0)
    off = hf_idx - plan.hf_start[j]
    ok &= off < plan.length[j]
    return (plan.p_start[j] + off)[ok], ok


@dataclass
class Write:
    """A delta's changed elements of one in-place tensor, worked out before the pause: the parameter, where they sit
    in it, and the values they take (the live base plus the delta, in the wider dtype, rounded once: what loading the
    trainer's target would have put there). The commit only scatters them."""

    name: str
    param: Any
    pos: Any  # int64 positions in the parameter's flat view
    values: Any  # in the parameter's dtype

    def apply(self, into: Any = None) -> None:
        """Into the live parameter, or ``into`` (a scratch copy of it)."""
        from app.engine.delta_format import scatter

        if self.pos.numel():
            scatter((self.param.data if into is None else into).view(-1), self.pos, self.values)


def prepare_write(plan: InPlace, rec: Any) -> Write:
    """The ``Write`` of a delta record on the tensor ``plan`` places, read against the live parameter now (which
    must not change until it is applied)."""
    import torch

    from app.engine.delta_format import gather

    if rec.indices.numel() == 0 or plan.hf_start.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return Write(rec.name, plan.param, empty, plan.param.data.new_empty(0))
    pos, ok = positions(plan, rec.indices)
    values = rec.values if bool(ok.all()) else rec.values[ok]
    flat = plan.param.data.view(-1)
    wide = torch.promote_types(flat.dtype, values.dtype)
    target = (gather(flat, pos).to(wide) + values.to(wide)).to(flat.dtype)
    return Write(rec.name, plan.param, pos, target)


def inplace_ok(module: Any) -> bool:
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
        # CPU: the embedding lookup reads the weight; its packed copy serves only an LM head sharing that weight (a
        # tied head), whose kernel the commit builds again from the new values (worker_delta.py).
        return bool(current_platform.is_cpu()) and not isinstance(module, ParallelLMHead)
    if isinstance(module, LinearBase):
        return cuda and isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod)
    return False


def locate(model: Any, name: str, packed: dict[str, list[str]]) -> tuple[Any, str, Any, str] | None:
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


def layout_plans(model: Any, vllm_config: Any, shapes: dict[str, tuple[int, ...]],
                 packed: dict[str, list[str]]) -> tuple[dict[str, InPlace | None], dict[str, tuple[str, str, Any]]]:
    """For each HF tensor (name -> shape): its in-place plan (None: its layer reloads), and where it lives."""
    plans: dict[str, InPlace | None] = {}
    where: dict[str, tuple[str, str, Any]] = {}
    quantized = getattr(vllm_config, "quant_config", None) is not None
    for name, shape in shapes.items():
        plans[name] = None
        found = locate(model, name, packed)
        if found is None:
            continue
        module, pname, shard, vname = found
        where[name] = (vname.rpartition(".")[0], pname, shard)
        param = module._parameters.get(pname)
        if quantized or param is None or not param.is_contiguous() or not inplace_ok(module):
            continue
        try:
            plans[name] = trace_param(param, shard, tuple(shape), module)
        except Exception as e:  # noqa: BLE001 - an unusual loader: that tensor reloads instead
            log.info("delta: %s is reloaded, not written in place (tracing its loader failed: %s)", name, e)
    return plans, where


def unwrapped_loader(loader: Any) -> Any:
    """The loader under vLLM's layerwise-reload wrapper (which, between reloads, loads nothing)."""
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def bound_to(value: Any, module: Any) -> Any:
    """A method vLLM's reload metadata keeps unbound from its layer (bound to a sentinel), bound to it again."""
    from types import MethodType

    import torch

    if module is not None and isinstance(value, MethodType) and not isinstance(value.__self__, torch.nn.Module):
        return value.__func__.__get__(module)
    return value


def shared_params(model: Any) -> set[int]:
    """ids of parameters held by more than one module (a tied LM head and embedding)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


TRACE_CHUNK = 1 << 24  # elements of the traced copy read at a time


def _runs(flat: Any) -> tuple[Any, Any, Any]:
    """The runs of consecutive HF elements (``flat[p] = hf + 1``, 0 or less: no HF element) in parameter order:
    their HF start, parameter start and length. Read ``TRACE_CHUNK`` elements at a time: at a tied embedding's size
    (Qwen3-4B: 389 M elements) whole-tensor int64 temporaries took ~10 GB of the worker's memory beside the model."""
    import torch

    hf_starts, p_starts, counts = [], [], []
    seen, last_hf, last_p = 0, -2, -2
    for base in range(0, flat.numel(), TRACE_CHUNK):
        chunk = flat[base:base + TRACE_CHUNK]
        pos = torch.nonzero(chunk > 0).view(-1)
        if pos.numel() == 0:
            continue
        hf = chunk[pos].to(torch.int64) - 1
        pos += base
        brk = torch.ones(pos.numel(), dtype=torch.bool)
        brk[1:] = (torch.diff(hf) != 1) | (torch.diff(pos) != 1)
        brk[0] = not (int(hf[0]) == last_hf + 1 and int(pos[0]) == last_p + 1)  # the previous chunk's run goes on
        starts = torch.nonzero(brk).view(-1)
        hf_starts.append(hf[starts])
        p_starts.append(pos[starts])
        counts.append(starts + seen)
        seen += pos.numel()
        last_hf, last_p = int(hf[-1]), int(pos[-1])
    if not counts:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty, empty
    at = torch.cat(counts)
    return torch.cat(hf_starts), torch.cat(p_starts), torch.diff(at, append=torch.tensor([seen]))


def trace_param(param: Any, shard: Any, hf_shape: tuple[int, ...], module: Any = None) -> InPlace | None:
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
        scratch.__dict__[k] = bound_to(v, module)
    loader = bound_to(unwrapped_loader(getattr(param, "weight_loader", None)), module)
    if loader is None:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        loader = default_weight_loader
    loader(scratch, marker) if shard is None else loader(scratch, marker, shard)
    del marker
    hf_start, p_start, length = _runs(scratch.data.view(-1))
    if hf_start.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return InPlace(param, empty, empty, empty)
    order = torch.argsort(hf_start)
    hf_start, p_start, length = hf_start[order], p_start[order], length[order]
    if bool((hf_start[1:] < hf_start[:-1] + length[:-1]).any()):
        return None  # an HF element placed twice: not a plain placement
    return InPlace(param, hf_start, p_start, length)
