"""LoRA adapter validation: everything checkable about a PEFT adapter directory before the engine sees it.

vLLM loads adapters inside the EngineCore; a bad adapter there is at best an opaque 500. Here the adapter's
``adapter_config.json`` and the header of ``adapter_model.safetensors`` are read (never the tensor data) and checked
against the served model's own checkpoint: rank, unsupported PEFT features, target modules, tensor names, dtypes and
shapes, and that the file is whole. Each failure is an ``ApiError`` with a message naming the problem.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.protocol import ApiError
from app.weights.safetensors_meta import HeaderError, read_tensors
from app.weights.safetensors_meta import TensorMeta as TensorInfo

log = logging.getLogger("tito.lora")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
ADAPTER_DTYPES = {"F32", "F16", "BF16"}
# PEFT features that change what an adapter computes and that vLLM does not implement.
_UNSUPPORTED_FLAGS = {"use_dora": "DoRA", "lora_bias": "LoRA bias", "use_qalora": "QALoRA",
                      "layer_replication": "layer_replication", "alora_invocation_tokens": "Activated LoRA",
                      "use_bdlora": "block-diagonal LoRA"}


@dataclass(frozen=True)
class AdapterInfo:
    """What validation learned about an adapter (kept in the registry and shown by the debug view)."""

    path: Path
    rank: int
    alpha: float
    target_modules: list[str]
    modules: int  # number of adapted modules (lora_A/lora_B pairs)


def bad(message: str, param: str = "lora_path") -> ApiError:
    return ApiError(400, message, param=param)


# --------------------------------------------------------------------------------------------- safetensors


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check a safetensors header without reading tensor data (app/weights/safetensors_meta.py)."""
    try:
        return read_tensors(path)
    except HeaderError as e:
        raise bad(str(e)) from None


@functools.lru_cache(maxsize=4)
def model_linear_shapes(model_dir: str) -> dict[str, tuple[int, int]] | None:
    """``{module name: (out_features, in_features)}`` for every 2-D ``*.weight`` in the served model's checkpoint.

    None when the model is not a local directory of safetensors (e.g. a hub id): then only the engine checks modules.
    """
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    try:
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in root.glob("*.safetensors"))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not files:
        return None
    shapes: dict[str, tuple[int, int]] = {}
    try:
        for fname in files:
            for key, t in read_safetensors_header(root / fname).items():
                if key.endswith(".weight") and len(t.shape) == 2:
                    shapes[key.removesuffix(".weight")] = (t.shape[0], t.shape[1])
    except ApiError as e:
        log.warning("cannot read the model's checkpoint headers (%s); adapter modules are checked by the engine only",
                    e.message)
        return None
    return shapes


# --------------------------------------------------------------------------------------------- config


def _pattern_value(pattern: dict[str, Any], module: str) -> Any:
    # PEFT's rule: a key matches when it is a suffix of the module name starting at a "." boundary; first wins.
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def _read_config(adapter: Path, max_rank: int) -> dict[str, Any]:
    cfg_path = adapter / CONFIG_FILE
    if not cfg_path.is_file():
        raise bad(f"{CONFIG_FILE} not found in {adapter} (not a PEFT LoRA adapter directory).")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"{CONFIG_FILE} in {adapter} is not valid JSON: {e}.") from None
    if not isinstance(cfg, dict):
        raise bad(f"{CONFIG_FILE} in {adapter} is not a JSON object.")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise bad(f"adapter peft_type is {peft_type!r}; only LORA adapters are served.")
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in cfg]
    if missing:
        raise bad(f"{CONFIG_FILE} lacks required field(s): {', '.join(missing)}.")
    r, alpha = cfg["r"], cfg["lora_alpha"]
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise bad(f"adapter rank r must be a positive integer, got {r!r}.")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise bad(f"adapter lora_alpha must be a number, got {alpha!r}.")
    tm = cfg["target_modules"]
    if not (isinstance(tm, str) or (isinstance(tm, list) and tm and all(isinstance(m, str) for m in tm))):
        raise bad(f"adapter target_modules must be a non-empty list of names or a regex string, got {tm!r}.")
    for k in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(k) or {}, dict):
            raise bad(f"adapter {k} must be an object.")
    ranks = [r, *(cfg.get("rank_pattern") or {}).values()]
    if not all(isinstance(x, int) and x > 0 for x in ranks):
        raise bad(f"adapter rank_pattern values must be positive integers, got {ranks[1:]}.")
    if max(ranks) > max_rank:
        raise bad(f"adapter rank {max(ranks)} is greater than the server's max_lora_rank {max_rank} "
                  "(restart tito with a larger --max-lora-rank).")
    problems = [what for flag, what in _UNSUPPORTED_FLAGS.items() if cfg.get(flag)]
    if cfg.get("bias", "none") != "none":
        problems.append(f"bias={cfg['bias']!r}")
    if any(m not in ("classifier", "score") for m in cfg.get("modules_to_save") or []):
        problems.append(f"modules_to_save={cfg['modules_to_save']}")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in ("gaussian", "eva", "orthogonal", "mica", "lora_ga"):
        problems.append(f"init_lora_weights={init!r} (it modifies the base weights)")
    if problems:
        raise bad(f"adapter uses features vLLM does not serve: {', '.join(problems)}.")
    return cfg


# --------------------------------------------------------------------------------------------- adapter

_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B")


def validate_adapter(adapter: Path, *, max_rank: int, model_dir: str) -> AdapterInfo:
    """Check a PEFT LoRA adapter directory; raises ``ApiError`` (404 missing, 400 anything wrong) or returns facts.

    Blocking file IO: call from a thread.
    """
    if not adapter.exists():
        raise ApiError(404, f"LoRA adapter directory {adapter} does not exist.", param="lora_path")
    if not adapter.is_dir():
        raise bad(f"lora_path {adapter} is not a directory.")
    cfg = _read_config(adapter, max_rank)
    weights = adapter / WEIGHTS_FILE
    if not weights.is_file():
        others = [f for f in ("adapter_model.bin", "adapter_model.pt") if (adapter / f).is_file()]
        hint = f" ({others[0]} found: tito loads safetensors adapters only)" if others else ""
        raise bad(f"{WEIGHTS_FILE} not found in {adapter}{hint}.")
    tensors = read_safetensors_header(weights)
    if not tensors:
        raise bad(f"{WEIGHTS_FILE} in {adapter} holds no tensors.")

    # Group tensors by the model module they adapt.
    pairs: dict[str, dict[str, TensorInfo]] = {}
    for key, t in tensors.items():
        if t.dtype not in ADAPTER_DTYPES:
            raise bad(f"adapter tensor {key!r} has dtype {t.dtype}; LoRA weights must be F32, F16 or BF16.")
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise bad(f"adapter tensor {key!r} is not a LoRA weight (expected names ending in "
                      f"{', '.join(_SUFFIXES)}).")
        module = key.removesuffix(suffix).removeprefix(PEFT_PREFIX)
        pairs.setdefault(module, {})[suffix] = t

    model_shapes = model_linear_shapes(model_dir)
    if model_shapes is not None:
        unknown = sorted(m for m in pairs if m not in model_shapes)
        if unknown:
            present = sorted({m.rsplit(".", 1)[-1] for m in model_shapes})
            raise bad(f"adapter targets module(s) the model does not have: {', '.join(unknown[:8])}"
                      f"{' ...' if len(unknown) > 8 else ''} (target_modules={cfg['target_modules']!r}; the model's "
                      f"modules are {', '.join(present)}).")

    rank_pattern = cfg.get("rank_pattern") or {}
    for module, parts in sorted(pairs.items()):
        a_key, b_key = (".lora_A.weight", ".lora_B.weight") if ".lora_A.weight" in parts or \
            ".lora_B.weight" in parts else (".lora_embedding_A", ".lora_embedding_B")
        a, b = parts.get(a_key), parts.get(b_key)
        if a is None or b is None:
            raise bad(f"adapter module {module!r} has {'lora_B' if a is None else 'lora_A'} without "
                      f"{'lora_A' if a is None else 'lora_B'}.")
        if len(parts) != 2:
            raise bad(f"adapter module {module!r} mixes linear and embedding LoRA tensors.")
        if len(a.shape) != 2 or len(b.shape) != 2:
            raise bad(f"adapter module {module!r}: lora_A and lora_B must be 2-D, got {list(a.shape)} and "
                      f"{list(b.shape)}.")
        want = _pattern_value(rank_pattern, module) or cfg["r"]
        # Both layouts are [r, in] and [out, r]; an embedding's "in" is its vocabulary (weight [vocab, hidden]).
        rank, in_a, out_b, rank_b = a.shape[0], a.shape[1], b.shape[0], b.shape[1]
        if rank != want or rank_b != want:
            raise bad(f"adapter module {module!r}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not have "
                      f"the configured rank {want}.")
        if model_shapes is not None:
            out_f, in_f = model_shapes[module]
            if a_key != ".lora_A.weight":
                out_f, in_f = in_f, out_f
            if (in_a, out_b) != (in_f, out_f):
                raise bad(f"adapter module {module!r}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit "
                          f"the model's weight (expected lora_A [{want}, {in_f}], lora_B [{out_f}, {want}]).")

    tm = cfg["target_modules"]
    return AdapterInfo(path=adapter, rank=max([cfg["r"], *rank_pattern.values()]), alpha=float(cfg["lora_alpha"]),
                       target_modules=[tm] if isinstance(tm, str) else list(tm), modules=len(pairs))

