"""LoRA adapters: the registry and the load / reload-in-place / unload orchestration, beside ``WeightManager``.

One ``LoraManager`` per server, on ``AppState.adapters``. Routers map HTTP to it (``routers/lora.py``); the engine is
reached through ``app.engine.adapter.Engine`` only (which builds vLLM's ``LoRARequest``).

The in-place flag is sent to the engine only on the reload call itself. Each entry's ``handle`` (what generation
sends) is built with ``load_inplace=False``: a request carrying the flag makes vLLM re-read the adapter from disk on
every scheduler step (Prime-RL issue #3356).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.core.metrics import LORA_LOAD_SECONDS, LORA_LOADS
from app.core.protocol import ApiError
from app.engine.adapter import EngineDead, EngineRejected, wait_or_timeout
from app.weights.lora_check import validate_adapter
from app.weights.paths import resolve_allowed

if TYPE_CHECKING:
    from app.core.settings import Settings
    from app.engine.adapter import Engine

log = logging.getLogger("tito.lora")

# Loading an adapter reads it from disk inside the EngineCore; generous, but never unbounded.
ENGINE_TIMEOUT = 300.0
LOCK_TIMEOUT = ENGINE_TIMEOUT + 30.0
# AReaL's versioned adapter names (areal.api.io_struct.get_versioned_lora_name): "<name>-v<N>".
_VERSIONED = re.compile(r"^(?P<base>.+)-v(?P<n>\d+)$")


@dataclass
class LoraEntry:
    name: str
    int_id: int
    path: str
    loaded_at: float
    rank: int = 0
    alpha: float = 0.0
    target_modules: list[str] = field(default_factory=list)
    reloads: int = 0  # in-place reloads under this name (same int_id)
    handle: Any = None  # the engine's request object generation passes (Engine.lora_request), built once


class LoraManager:
    """The adapter registry. Loads and unloads are serialized (admin calls, one per RL step); ids are never reused."""

    def __init__(self, engine: Engine, settings: Settings, *, check_engine: Callable[[], None],
                 inflight: Callable[[], int]) -> None:
        """``check_engine()`` raises 503 when the engine is dead; ``inflight()`` counts the requests in flight."""
        self.engine = engine
        self.settings = settings
        self._check_engine = check_engine
        self._inflight = inflight
        self.entries: dict[str, LoraEntry] = {}
        self.lock = asyncio.Lock()
        self.next_id = 1

    def resolve(self, name: str) -> LoraEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model")
        return entry

    def _require_lora(self) -> None:
        if not self.engine.facts.enable_lora:
            raise ApiError(400, "LoRA is not enabled on this server; start tito with --enable-lora "
                                "(and --max-lora-rank/--max-loras).")
        self._check_engine()

    @asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        try:
            await asyncio.wait_for(self.lock.acquire(), LOCK_TIMEOUT)
        except TimeoutError:
            raise ApiError(503, f"another LoRA adapter operation has held the lock for over {LOCK_TIMEOUT:g}s; "
                                "try again later.", headers={"Retry-After": "10"}) from None
        try:
            yield
        finally:
            self.lock.release()

    def _refusal(self, name: str, e: BaseException) -> BaseException:
        if isinstance(e, TimeoutError):
            return ApiError(504, f"the engine did not finish loading LoRA adapter '{name}' within "
                                 f"{ENGINE_TIMEOUT:g}s; its state is unknown, load it again.")
        if isinstance(e, EngineDead):
            return ApiError(503, f"engine is dead: {e}")
        if isinstance(e, EngineRejected):
            # The adapter passed tito's checks, so what is left is the engine's own refusal (e.g. a module vLLM
            # cannot put LoRA on, such as lm_head); the engine keeps serving.
            return ApiError(400, f"the engine refused LoRA adapter '{name}': {e}", param="lora_path")
        return e

    async def load(self, name: str, raw_path: str, *, inplace: bool, trusted: bool = False) -> LoraEntry:
        """Validate then load (or, with ``inplace``, reload under the same id) an adapter; returns its entry.
        ``trusted``: a directory tito wrote itself (AReaL's broadcast adapters), outside the request allow-list."""
        facts, engine, settings = self.engine.facts, self.engine, self.settings
        self._require_lora()
        if not name or not raw_path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in (facts.name, facts.path):
            raise ApiError(400, f"The lora adapter '{name}' conflicts with a served base model.", param="lora_name")
        path = Path(raw_path).resolve() if trusted else resolve_allowed(settings, raw_path, "lora_path")

        async with self._exclusive():
            existing = self.entries.get(name)
            if existing is not None and not inplace:
                raise ApiError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                    "adapter in place, set 'load_inplace' to True.", param="lora_name")
            kind = "reload" if existing is not None else "load"
            t0 = time.monotonic()
            try:
                info = await asyncio.to_thread(validate_adapter, path, max_rank=facts.max_lora_rank,
                                               model_dir=settings.model)
                if existing is not None:
                    int_id = existing.int_id
                else:
                    int_id, self.next_id = self.next_id, self.next_id + 1
                try:
                    # load_inplace only on this call: it makes the engine replace the cached weights of int_id.
                    await wait_or_timeout(engine.add_lora(name, int_id, str(path),
                                                          load_inplace=existing is not None), ENGINE_TIMEOUT)
                except (TimeoutError, EngineDead, EngineRejected) as e:
                    raise self._refusal(name, e) from None
            except Exception as e:
                LORA_LOADS.labels(kind, "error").inc()
                log.warning("LoRA adapter %s '%s' from %s failed after %.2fs: %s", kind, name, path,
                            time.monotonic() - t0, e.message if isinstance(e, ApiError) else repr(e))
                raise

            if existing is not None and existing.path == str(path):
                # Prefix-cache blocks are keyed by adapter name and path, so a same-path reload would reuse KV
                # computed with the old weights.
                if not await wait_or_timeout(engine.reset_prefix_cache(), ENGINE_TIMEOUT):
                    log.warning("LoRA adapter '%s' reloaded from the same path but the prefix cache could not be "
                                "reset (requests running); cached prefixes may reflect the old weights", name)
            entry = LoraEntry(name=name, int_id=int_id, path=str(path), loaded_at=time.time(), rank=info.rank,
                              alpha=info.alpha, target_modules=info.target_modules,
                              reloads=existing.reloads + 1 if existing is not None else 0,
                              handle=engine.lora_request(name, int_id, str(path)))
            self.entries[name] = entry
            seconds = time.monotonic() - t0
            LORA_LOADS.labels(kind, "ok").inc()
            LORA_LOAD_SECONDS.observe(seconds)
            log.info("LoRA adapter %s '%s' (id %d, rank %d, %d modules) from %s in %.2fs", kind, name, int_id,
                     info.rank, info.modules, path, seconds)
            await self._prune_versions(name)
            return entry

    async def _prune_versions(self, name: str) -> None:
        """``--lora-keep-versions k``: after ``<base>-v<N>`` loads, only the newest k versions of ``<base>`` stay
        (AReaL loads a new version every step and never unloads one). Called under the lock."""
        keep = self.settings.lora_keep_versions
        m = _VERSIONED.match(name)
        if not keep or m is None:
            return
        versions = sorted(((int(v.group("n")), e) for e in self.entries.values()
                           if (v := _VERSIONED.match(e.name)) and v.group("base") == m.group("base")),
                          key=lambda x: x[0], reverse=True)
        for _, entry in versions[keep:]:
            del self.entries[entry.name]
            await self._drop(entry)

    async def unload(self, name: str) -> None:
        self._require_lora()
        if not name:
            raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._exclusive():
            entry = self.entries.pop(name, None)
            if entry is None:
                raise ApiError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
            await self._drop(entry)

    async def _drop(self, entry: LoraEntry) -> None:
        """An adapter just taken out of the registry; called under the lock."""
        name = entry.name
        # From here no new request can select it. Free it in the engine only when nothing is in flight: an
        # in-flight request still using it would make the engine re-read it from disk, which may be gone by
        # then. Otherwise the engine's LRU cache (--max-cpu-loras) evicts it later; ids are never reused.
        freed = False
        if self._inflight() == 0:
            try:
                freed = await wait_or_timeout(self.engine.remove_lora(entry.int_id), ENGINE_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - the adapter is unloaded from the registry either way
                log.warning("engine could not drop LoRA adapter '%s' (id %d): %s", name, entry.int_id, e)
        LORA_LOADS.labels("unload", "ok").inc()
        log.info("LoRA adapter unload '%s' (id %d)%s", name, entry.int_id,
                 "" if freed else "; the engine's cache evicts it later")

    def view(self, entry: LoraEntry) -> dict[str, object]:
        return {"lora_name": entry.name, "lora_int_id": entry.int_id, "lora_path": entry.path, "rank": entry.rank,
                "alpha": entry.alpha, "target_modules": entry.target_modules, "loaded_at": entry.loaded_at,
                "reloads": entry.reloads,
                # What generation sends to the engine for this adapter: must never carry load_inplace.
                "request": self.engine.describe_lora(entry.handle)}
