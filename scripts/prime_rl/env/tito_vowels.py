"""A small verifiers taskset for Prime-RL runs against tito: ``taskset = { id = "tito-vowels" }``.

Each task asks for a short reply; the reward is the share of the reply's letters that are vowels. A random policy's
replies score anywhere in [0, 1], so every group of rollouts has non-zero advantages (Prime-RL drops zero-advantage
tokens before training) and a policy-gradient step moves the policy towards vowel-rich tokens, on any tokenizer.
Finite and deterministic: ``TASKS`` prompts, in order, each named (the prompts repeat; a task's key is its data's
hash, so the name keeps the keys unique).
"""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf

PROMPTS = [
    "Say something.", "Tell me a story.", "Write a short poem.", "What is the weather like?", "Count to ten.",
    "Name a city.", "Describe the sea.", "Hello, how are you today?",
]
TASKS = 64
VOWELS = set("aeiouAEIOU")


class VowelTask(vf.Task):
    @vf.reward
    async def vowel_share(self, trace: vf.Trace) -> float:
        replies = [m for m in trace.messages if _role(m) == "assistant"]
        text = "".join(_text(m) for m in replies)
        letters = [c for c in text if c.isalpha()]
        return sum(c in VOWELS for c in letters) / len(letters) if letters else 0.0


class VowelTaskset(vf.Taskset[VowelTask]):
    def load(self) -> Iterable[VowelTask]:
        for i in range(TASKS):
            yield VowelTask(vf.TaskData(name=f"vowels-{i}", prompt=PROMPTS[i % len(PROMPTS)]), self.config.task)


def _role(message: object) -> str:
    return getattr(message, "role", None) or (message.get("role", "") if isinstance(message, dict) else "")


def _text(message: object) -> str:
    content = getattr(message, "content", None) if not isinstance(message, dict) else message.get("content")
    if isinstance(content, str):
        return content
    return "".join(getattr(p, "text", "") or (p.get("text", "") if isinstance(p, dict) else "") for p in content or [])


__all__ = ["VowelTaskset"]
