"""A fake of the engine adapter (``app.engine.adapter.Engine``) for fast HTTP-logic tests: ``create_app(settings,
engine=FakeEngine())``. It implements the adapter's interface and answers like it (outputs shaped like vLLM's
``RequestOutput``), with no model behind it: the tokens it "generates" count up from the prompt's last id.

Never the evidence that a feature works (the real-engine tests are); it covers validation, admission, drain, auth,
error envelopes and the client, in seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from app.engine.adapter import EngineDead, EngineRejected, ModelFacts
from app.engine.worker_calls import WorkerCalls

# The limits of the tiny test model (app/tiny/model.py), so the real-engine tests' bad-input cases apply unchanged.
FACTS = ModelFacts(name="fake-model", path="/models/fake", dtype="float32", max_model_len=512, vocab_size=512,
                   max_num_seqs=16, max_logprobs=20, priority_scheduling=False, data_parallel_size=1,
                   tensor_parallel_size=1, pipeline_parallel_size=1, enable_lora=False, max_loras=0, max_lora_rank=0)


async def until(done: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait (on the event loop the app runs on) until ``done()`` holds; fail after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not done():
        assert asyncio.get_running_loop().time() < deadline, f"not done after {timeout} s"
        await asyncio.sleep(0.001)


@dataclass
class FakeCompletion:
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Any = None
    weight_versions: Any = None
    routed_experts: Any = None  # vLLM's capture: a [positions, moe_layers, top_k] array on finished outputs


@dataclass
class FakeOutput:
    request_id: str
    outputs: list[FakeCompletion]
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    prompt_logprobs: Any = None
    kv_transfer_params: Any = None
    finished: bool = False


@dataclass
class FakeLora:
    lora_name: str
    lora_int_id: int
    lora_path: str
    load_inplace: bool = False


@dataclass
class FakeEngine(WorkerCalls):
    """The broadcast and AReaL calls are the adapter's own (``WorkerCalls``), recorded by ``collective_rpc``."""

    facts: ModelFacts = FACTS
    # While cleared, generation waits after its first token (tests that must act while requests run).
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    fail_with: BaseException | None = None  # raised by the next generations
    errored: bool = False
    paused: bool = False
    ping_delay: float = 0.0
    lora_refusal: str | None = None  # add_lora raises EngineRejected with it
    started: int = 0  # generations begun
    aborted: list[str] = field(default_factory=list)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    weight_version: str = "default"
    delta_fail: BaseException | None = None  # raised by the next delta_commit (after "changing" the model)
    delta_delay: float = 0.0  # seconds each delta_commit takes
    # While cleared, delta_commit waits (after recording its call) until it is set: a commit held in its apply.
    commit_gate: asyncio.Event = field(default_factory=asyncio.Event)
    held: int = 0  # generations waiting at the cleared ``gate`` right now
    _delta_version: str | None = None  # the version the "workers' copy" holds
    delta_ready_after: int | None = None  # a staged delta is "made ready" after this many status looks (None: never)
    _pending: dict[str, Any] | None = None
    routed_experts: Any = None  # what the "engine" captured for every finished output (--enable-return-routed-experts)

    def __post_init__(self) -> None:
        self.gate.set()
        self.commit_gate.set()

    @classmethod
    def with_lora(cls, **kw: Any) -> FakeEngine:
        return cls(facts=replace(FACTS, enable_lora=True, max_loras=2, max_lora_rank=16), **kw)

    # ------------------------------------------------------------------ generation

    def generate(self, token_ids: list[int], params: Any, request_id: str, *, cache_salt: str | None = None,
                 lora: Any = None, priority: int = 0, data_parallel_rank: int | None = None,
                 prompt: Any = None) -> AsyncIterator[FakeOutput]:
        self.calls.append(("generate", {"request_id": request_id, "lora": lora, "rank": data_parallel_rank}))
        return self._run(list(token_ids), params, request_id)

    async def _run(self, prompt: list[int], params: Any, request_id: str) -> AsyncIterator[FakeOutput]:
        self.started += 1
        if self.fail_with is not None:
            raise self.fail_with
        delta = params.output_kind.name == "DELTA"
        n, max_tokens = params.n, params.max_tokens or 4
        made: list[list[int]] = [[] for _ in range(n)]
        for step in range(max_tokens):
            if step == 1 and not self.gate.is_set():
                self.held += 1
                try:
                    await self.gate.wait()
                finally:
                    self.held -= 1
            if request_id in self.aborted:
                break
            for i in range(n):
                made[i].append((prompt[-1] + 1 + step + i) % self.facts.vocab_size)
            last = step == max_tokens - 1
            if delta:
                yield FakeOutput(request_id, [FakeCompletion(i, [made[i][-1]], "length" if last else None)
                                              for i in range(n)], prompt, finished=last)
            await asyncio.sleep(0)
        reason = "abort" if request_id in self.aborted else "length"
        if delta:
            if reason == "abort":
                yield FakeOutput(request_id, [FakeCompletion(i, [], "abort") for i in range(n)], prompt, finished=True)
            return
        yield FakeOutput(request_id, [FakeCompletion(i, made[i], reason, routed_experts=self.routed_experts)
                                      for i in range(n)], prompt, finished=True)

    async def abort(self, request_ids: str | Iterable[str], internal: bool = False) -> None:
        self.aborted += [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.gate.set()

    async def warmup(self) -> None:
        pass

    def translate_error(self, e: BaseException, *, refused: bool = False) -> BaseException:
        if isinstance(e, (EngineDead, EngineRejected, TimeoutError, asyncio.CancelledError)):
            return e
        if self.errored:
            return EngineDead(str(e))
        if refused or isinstance(e, (ValueError, TypeError, OverflowError)):
            return EngineRejected(str(e), getattr(e, "parameter", None))
        return e

    # ------------------------------------------------------------------ control

    async def pause(self, mode: str = "abort", clear_cache: bool = True, settle: bool = True) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False

    async def is_paused(self, *, ask_engine: bool = False) -> bool:
        return self.paused

    @property
    def paused_record(self) -> bool | None:
        return self.paused

    def assume_paused(self, paused: bool | None) -> None:
        self.paused = bool(paused)

    def mark_dead(self) -> None:
        self.errored = True

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_external: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache", reset_running_requests))
        return True

    cache_epoch: str | None = None

    def kept_cache_across_update(self) -> None:
        self.calls.append(("kept_cache_across_update", None))
        self.cache_epoch = f"tito-weights-{sum(1 for c in self.calls if c[0] == 'kept_cache_across_update')}"

    async def ping_workers(self, timeout: float) -> None:
        await asyncio.wait_for(asyncio.sleep(self.ping_delay), timeout)

    async def collective_rpc(self, method: str, *, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                             timeout: float | None = None) -> list[Any]:
        self.calls.append((method, kwargs))
        return [None]

    # ------------------------------------------------------------------ LoRA

    @staticmethod
    def lora_request(name: str, lora_id: int, path: str, *, load_inplace: bool = False) -> FakeLora:
        return FakeLora(name, lora_id, path, load_inplace)

    @staticmethod
    def describe_lora(handle: FakeLora) -> dict[str, Any]:
        return dict(handle.__dict__)

    async def add_lora(self, name: str, lora_id: int, path: str, *, load_inplace: bool = False) -> bool:
        self.calls.append(("add_lora", (name, lora_id, path, load_inplace)))
        if self.lora_refusal:
            raise EngineRejected(self.lora_refusal)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.calls.append(("remove_lora", lora_id))
        return True

    # ------------------------------------------------------------------ weights and facts (recorded; no model here)

    async def delta_prepare(self, version: str, files: list[str] | None, delta: dict[str, str] | None = None,
                            copy_dir: str | None = None) -> list[Any]:
        self.calls.append(("delta_prepare", {"version": version, "files": files, "delta": delta}))
        held = self._delta_version
        if files is None and held != version:
            return [{"state": "missing", "version": held}]
        self._delta_version = version
        if delta is not None and self.delta_ready_after is not None:
            self._pending = {"version": delta["version"], "state": "preparing", "looks": self.delta_ready_after}
        return [{"state": "ready", "version": version}]

    async def delta_status(self) -> list[Any]:
        p = self._pending
        if p is not None:
            p["looks"] -= 1
            if p["looks"] <= 0:
                p["state"] = "ready"
        return [{"state": "ready" if self._delta_version else "empty", "version": self._delta_version,
                 "pending": None if p is None else {"version": p["version"], "state": p["state"]}}]

    async def delta_layout(self, shapes: dict[str, list[int]]) -> list[Any]:
        return [{n: {"param": n, "shard": None, "shape": s, "inplace": False, "runs": None} for n, s in shapes.items()}]

    async def delta_commit(self, path: str, base: str, version: str) -> list[Any]:
        self.calls.append(("delta_commit", {"path": path, "base": base, "version": version}))
        await self.commit_gate.wait()
        await asyncio.sleep(self.delta_delay)
        if self.delta_fail is not None:
            err, self.delta_fail = self.delta_fail, None
            self._delta_version = None
            raise err
        self._delta_version = version
        return [{"reload_seconds": 0.0, "inplace": 0}]

    async def load_checkpoint(self, files: list[str], skip: list[str]) -> list[Any]:
        self._delta_version = None
        return await super().load_checkpoint(files, skip)

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init_weight_transfer_engine", init_info))

    async def start_weight_update(self) -> None:
        self.calls.append(("start_weight_update", None))

    async def update_weights(self, update_info: Any) -> None:
        self.calls.append(("update_weights", update_info))

    async def finish_weight_update(self, weight_version: str | None) -> None:
        self.calls.append(("finish_weight_update", weight_version))

    @property
    def weight_transfer_backend(self) -> str | None:
        return None

    def world_size(self, include_dp: bool = True) -> int:
        return 1

    async def get_weight_version(self) -> str:
        return self.weight_version

    async def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    def kv_event_endpoints(self) -> dict[int, str]:
        return {}

    def kv_event_replay_endpoints(self) -> dict[int, str]:
        return {}

    def kv_event_sources(self) -> list[dict[str, Any]]:
        return []

    def scheduler_load(self) -> tuple[int, int, float] | None:
        return None

    def shutdown(self) -> None:
        pass

    # ------------------------------------------------------------------ vLLM's OpenAI layer (tests/fake_openai.py)

    def openai_layer(self, loras: Any, media: Any) -> Any:
        from tests.fake_openai import FakeOpenAILayer

        return FakeOpenAILayer(self)

    def vllm_server_info(self, config_format: str) -> dict[str, Any]:
        cfg = {"model_config": {"dtype": "torch.float32"}, "weight_transfer_config": None}
        return {"vllm_config": cfg if config_format == "json" else repr(cfg), "vllm_env": {}}
