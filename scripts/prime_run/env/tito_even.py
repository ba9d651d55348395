"""A small verifiers taskset for Prime-RL runs against tito: ``taskset = { id = "tito-even" }``.

Each task asks for a short reply; the reward is the share of the reply's sampled token ids that are even. It reads
token ids, not text, so it holds on any tokenizer (a random model of a real shape samples mostly ids its small
tokenizer decodes to nothing); a random policy scores about 0.5 with a spread, so every group of rollouts has non-zero
advantages (Prime-RL drops zero-advantage tokens before training), and a policy-gradient step moves the policy
towards even ids through the head. Finite and deterministic: ``TASKS`` prompts, in order, each named (the prompts
repeat; a task's key is its data's hash, so the name keeps the keys unique).
"""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf

PROMPTS = [
    "Say something.", "Tell me a story.", "Write a short poem.", "What is the weather like?", "Count to ten.",
    "Name a city.", "Describe the sea.", "Hello, how are you today?",
]
TASKS = 64


class EvenTask(vf.Task):
    @vf.reward
    async def even_share(self, trace: vf.Trace) -> float:
        sampled = [t for b in trace.branches for t, s in zip(b.token_ids, b.sampled_mask, strict=True) if s]
        return sum(t % 2 == 0 for t in sampled) / len(sampled) if sampled else 0.0


class EvenTaskset(vf.Taskset[EvenTask]):
    def load(self) -> Iterable[EvenTask]:
        for i in range(TASKS):
            yield EvenTask(vf.TaskData(name=f"even-{i}", prompt=PROMPTS[i % len(PROMPTS)]), self.config.task)


__all__ = ["EvenTaskset"]
