"""AReaL's weight sync ("xccl") on tito's update rules: the group, the announced tensors, full and LoRA updates.

AReaL's ``RemotevLLMEngine`` (areal/engine/vllm_remote.py) calls, per trainer step: ``/areal_pause_generation``,
then per bucket of tensors ``/areal_set_update_weight_meta`` (names, dtypes, shapes) and ``/areal_update_weights_xccl``
(the trainer broadcasts each announced tensor from rank 0 while that call runs), then ``/areal_continue_generation``.
Everything a bucket announces is checked here against the served model before the engine is touched (400); the
receive runs as a weight update (one at a time, under the control plane's lock, ``WeightManager.apply``), and the
model changes only once the last tensor of the model has arrived (app/engine/worker_areal.py), so a trainer that stops
midway leaves the old weights served; a reload that fails midway leaves the server "weights inconsistent", as every
other update path does.

LoRA: ``/areal_set_update_weight_meta_lora`` + ``/areal_update_weights_lora_xccl`` carry PEFT tensors; they are
written as a PEFT adapter directory (tito's own, outside the request allow-list) and loaded under AReaL's versioned
name ``<name>-v<N>`` like any other adapter (validated by app/weights/lora_check.py); ``--lora-keep-versions`` bounds
how many versions stay loaded.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.core.protocol import ApiError
from app.engine.worker_areal import DTYPES
from app.weights.updates import UpdateOutcome, derive_version, is_buffer, shielded_call, worker_error

if TYPE_CHECKING:
    from app.engine.adapter import Engine
    from app.weights.lora import LoraEntry, LoraManager
    from app.weights.updates import WeightManager

log = logging.getLogger("tito.areal")

# Seconds a worker waits for the rendezvous and for each broadcast (AReaL sends no timeout of its own).
GROUP_TIMEOUT = 300.0
MAX_TENSORS = 100_000
_LORA_NAME = re.compile(r"\.lora_[AB](\.default)?\.weight$")
_LORA_DTYPES = ("float32", "float16", "bfloat16")
_SAFETENSORS_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
                      "int32": "I32", "int8": "I8", "uint8": "U8"}


@dataclass
class Meta:
    group_name: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    lora: dict[str, Any] | None = None  # lora_name, rank, alpha, target_modules, bias


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


class ArealSync:
    """One per server (``AppState.areal``)."""

    def __init__(self, engine: Engine, weights: WeightManager, adapters: LoraManager,
                 guard: Callable[[str, Callable[[], Awaitable[UpdateOutcome]]], Callable[[], Awaitable[UpdateOutcome]]],
                 *, check_engine: Callable[[], None]) -> None:
        """``guard``: the control plane's (an update's turn in the pause/resume order); ``check_engine()`` raises
        503 when the engine is dead."""
        self.engine, self.weights, self.adapters, self.guard = engine, weights, adapters, guard
        self._check_engine = check_engine
        self.groups: dict[str, dict[str, Any]] = {}
        self.meta: Meta | None = None
        self.pending: set[str] = set()  # tensors of a full update received so far (buffered in the workers)
        self.lora_dirs: dict[str, Path] = {}  # adapter name -> the directory tito wrote for it

    # ------------------------------------------------------------------ the group

    async def join(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                   group_name: str) -> list[Any]:
        mgr = self.weights
        if mgr.busy or mgr.lock.locked():
            raise ApiError(409, "a weight update is running; call /areal_init_weights_update_group when it has "
                                "finished.")
        self.groups.pop(group_name, None)
        self.pending.clear()
        results = await self._call(self.engine.areal("join", host=host, port=port, rank_offset=rank_offset,
                                                          world_size=world_size, backend=backend,
                                                          group_name=group_name, timeout=GROUP_TIMEOUT),
                                   "joining AReaL's weight group")
        self.groups[group_name] = {"host": host, "port": port, "world_size": world_size, "backend": backend,
                                   "ranks": sorted(int(r["rank"]) for r in results if isinstance(r, dict))}
        return results

    async def _call(self, aw: Awaitable[Any], what: str) -> Any:
        return await shielded_call(aw, what, self._check_engine)

    # ------------------------------------------------------------------ announced tensors

    def _check_common(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                      allowed: tuple[str, ...]) -> None:
        if group_name not in self.groups:
            raise _bad(f"no weight group named {group_name!r}: call /areal_init_weights_update_group first.",
                       "group_name")
        if not names:
            raise _bad("names must not be empty.", "names")
        if len(names) > MAX_TENSORS:
            raise _bad(f"at most {MAX_TENSORS} tensors per call, got {len(names)}.", "names")
        if not len(names) == len(dtypes) == len(shapes):
            raise _bad(f"names, dtypes and shapes must have the same length, got {len(names)}, {len(dtypes)}, "
                       f"{len(shapes)}.", "names")
        if len(set(names)) != len(names):
            raise _bad("names must not repeat a tensor.", "names")
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            if dtype not in allowed:
                raise _bad(f"dtype {dtype!r} of {name!r} is not one of {', '.join(allowed)}.", "dtypes")
            if any(d < 0 for d in shape) or math.prod(shape) > 2**40:
                raise _bad(f"shape {shape} of {name!r} is not a tensor shape.", "shapes")

    async def set_meta(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        """A full-weight bucket: every tensor must be one of the model's, in its shape, not sent before."""
        self._check_common(group_name, names, dtypes, shapes, DTYPES)
        expected = await self.weights.expected()
        unknown = [n for n in names if n not in expected and not is_buffer(n)]
        if unknown:
            raise _bad(f"{len(unknown)} tensor(s) the model lacks: {', '.join(unknown[:8])}.", "names")
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            want = expected.get(name)
            if want is not None and tuple(shape) != want.shape:
                raise _bad(f"shape mismatch for {name!r}: announced {shape}, the model expects {list(want.shape)}.",
                           "shapes")
            if want is not None and _SAFETENSORS_DTYPE[dtype] not in ("F32", "F16", "BF16", want.dtype):
                raise _bad(f"dtype {dtype} of {name!r} cannot be loaded into a {want.dtype} tensor.", "dtypes")
        again = sorted(set(names) & self.pending)
        if again:
            raise _bad(f"tensor(s) already received in this update: {', '.join(again[:8])}.", "names")
        self.meta = Meta(group_name, list(names), list(dtypes), [list(s) for s in shapes])

    def set_meta_lora(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                      lora: dict[str, Any]) -> None:
        self._check_common(group_name, names, dtypes, shapes, _LORA_DTYPES)
        if not self.engine.facts.enable_lora:
            raise _bad("LoRA is not enabled on this server; start tito with --enable-lora.")
        rank, max_rank = int(lora["rank"]), self.engine.facts.max_lora_rank
        if not 0 < rank <= max_rank:
            raise _bad(f"lora_rank {rank} must be between 1 and the server's --max-lora-rank ({max_rank}).",
                       "lora_rank")
        if lora["bias"] != "none":
            raise _bad(f"lora_bias {lora['bias']!r} is not supported (vLLM serves bias 'none').", "lora_bias")
        odd = [n for n in names if not _LORA_NAME.search(n)]
        if odd:
            raise _bad(f"not LoRA tensors (names ending in lora_A/lora_B[.default].weight): {', '.join(odd[:8])}.",
                       "names")
        self.meta = Meta(group_name, list(names), list(dtypes), [list(s) for s in shapes], lora)

    def _take(self, lora: bool) -> Meta:
        meta = self.meta
        if meta is None or (meta.lora is not None) != lora:
            route = "/areal_set_update_weight_meta_lora" if lora else "/areal_set_update_weight_meta"
            raise ApiError(400, f"no tensors announced: call {route} first.")
        self.meta = None
        return meta

    # ------------------------------------------------------------------ full weights

    async def update(self) -> UpdateOutcome:
        meta = self._take(lora=False)
        mgr = self.weights
        expected = [n for n in await mgr.expected() if not is_buffer(n)]
        complete = set(expected) <= self.pending | set(meta.names)
        kw = dict(group_name=meta.group_name, names=meta.names, dtypes=meta.dtypes, shapes=meta.shapes,
                  expected=expected, apply=complete, timeout=GROUP_TIMEOUT)

        async def receive() -> list[Any]:
            try:
                return await self.engine.areal("receive", **kw)
            except BaseException:
                self.pending.clear()
                self.groups.pop(meta.group_name, None)  # the workers dropped it
                raise

        async def work() -> UpdateOutcome:
            if not complete:
                # Only received (the workers hold it): the model does not change until the last bucket.
                t0 = asyncio.get_running_loop().time()
                try:
                    got = await receive()
                except Exception as e:  # noqa: BLE001
                    self._check_engine()
                    raise worker_error(e, "receiving AReaL's broadcast") from None
                self.pending |= set(meta.names)
                nbytes = sum(int(r.get("bytes", 0)) for r in got if isinstance(r, dict)) // max(len(got), 1)
                return UpdateOutcome(mgr.version, "areal-xccl", asyncio.get_running_loop().time() - t0, nbytes,
                                     noop=True)
            mgr.counter += 1
            label = derive_version(None, None, mgr.counter)
            results: list[Any] = []

            async def load() -> list[Any]:
                results.extend(await receive())
                self.pending.clear()
                return results

            out = await mgr.apply("areal-xccl", load, label, 0, "receiving AReaL's weight broadcast")
            out.bytes = sum(int(r.get("bytes", 0)) for r in results if isinstance(r, dict)) // max(len(results), 1)
            return out

        return await mgr.run(None, self.guard("weight update (areal xccl)", work))

    # ------------------------------------------------------------------ LoRA

    async def update_lora(self) -> LoraEntry:
        meta = self._take(lora=True)
        assert meta.lora is not None
        name = str(meta.lora["lora_name"])
        directory = Path(tempfile.mkdtemp(prefix="tito-areal-lora-"))
        modules = sorted({_LORA_NAME.sub("", n).rsplit(".", 1)[-1] for n in meta.names})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(meta.lora["rank"]),
                  "lora_alpha": meta.lora["alpha"], "target_modules": modules, "bias": "none",
                  "base_model_name_or_path": meta.lora.get("base_model_name")}
        try:
            try:
                await self._call(self.engine.areal("receive_lora", group_name=meta.group_name, names=meta.names,
                                                                dtypes=meta.dtypes, shapes=meta.shapes,
                                                                directory=str(directory), config=config,
                                                                timeout=GROUP_TIMEOUT),
                                 "receiving AReaL's LoRA broadcast")
            except BaseException:
                self.groups.pop(meta.group_name, None)
                raise
            entry = await self.adapters.load(name, str(directory), inplace=True, trusted=True)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        old = self.lora_dirs.get(name)
        self.lora_dirs[name] = directory
        if old is not None and old != directory:  # a resend of the same version replaced it
            shutil.rmtree(old, ignore_errors=True)
        # Directories of versions no longer served (past --lora-keep-versions, or unloaded) go.
        for gone in [n for n in self.lora_dirs if n not in self.adapters.entries]:
            shutil.rmtree(self.lora_dirs.pop(gone), ignore_errors=True)
        return entry

    def info(self) -> dict[str, Any]:
        return {"groups": self.groups, "pending_tensors": len(self.pending),
                "announced": None if self.meta is None else len(self.meta.names)}
