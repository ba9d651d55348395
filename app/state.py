"""AppState: the one object that holds what the server knows, built in the lifespan, reached through dependencies."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from app.engine import Engine, ModelFacts
from app.protocol import ApiError
from app.sampling import Limits
from app.settings import Settings

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest


@dataclass
class LoraEntry:
    name: str
    int_id: int
    path: str
    loaded_at: float


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    started_at: float = field(default_factory=time.time)
    # Admission: draining/shutting-down refuse new generate requests; in-flight is counted for drain.
    draining: bool = False
    shutting_down: bool = False
    ready: bool = False
    inflight: int = 0
    weight_version: str = "default"
    loras: dict[str, LoraEntry] = field(default_factory=dict)
    engine_failure: dict[str, Any] | None = None
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        f = self.engine.facts
        self.limits = Limits(vocab_size=f.vocab_size, max_model_len=f.max_model_len, max_num_seqs=f.max_num_seqs,
                             max_logprobs=f.max_logprobs, priority_scheduling=f.priority_scheduling)
        self._idle.set()

    @property
    def facts(self) -> ModelFacts:
        return self.engine.facts

    # ------------------------------------------------------------------ admission

    def check_engine(self) -> None:
        if self.engine.errored:
            cause = (self.engine_failure or {}).get("cause") or str(self.engine.dead_error)
            raise ApiError(503, f"engine is dead: {cause}")

    def admit(self) -> None:
        """Gate for new generate requests: raises 503 when the server will not take new work."""
        self.check_engine()
        if self.shutting_down:
            raise ApiError(503, "server is shutting down; send the request to another replica.",
                           headers={"Retry-After": "5"})
        if self.draining:
            raise ApiError(503, "server is draining; send the request to another replica.",
                           headers={"Retry-After": "5"})

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; True if reached within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    # ------------------------------------------------------------------ models

    def resolve_model(self, name: str | None) -> LoRARequest | None:
        """Map the request's ``model`` to the base model (None) or a loaded LoRA adapter; unknown → 404."""
        if not name or name == self.facts.name or name == self.facts.path:
            return None
        entry = self.loras.get(name)
        if entry is None:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model")
        from vllm.lora.request import LoRARequest

        return LoRARequest(entry.name, entry.int_id, entry.path)


def get_state(request: Request) -> AppState:
    """FastAPI dependency: the AppState of the app serving this request."""
    state: AppState | None = getattr(request.app.state, "tito", None)
    if state is None:
        raise ApiError(503, "server is starting")
    return state
