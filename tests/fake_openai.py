"""A fake of the engine adapter's OpenAI layer (app/engine/openai_layer.py ``OpenAILayer``) for fast HTTP tests of
routers/openai.py: it takes the same ``Gate`` (limits, in-flight accounting) and answers token-id completions from
the fake engine in the completions shape. vLLM's own handlers are exercised by the real-engine tests only."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from app.core.protocol import ApiError, bad_request
from app.engine.openai_layer import NO_TOKENIZER, Answer, Gate
from app.engine.sampling import check_prompt


class _Params:
    """What the fake engine reads of SamplingParams."""

    def __init__(self, n: int, max_tokens: int, stream: bool) -> None:
        self.n, self.max_tokens = n, max_tokens
        self.output_kind = type("Kind", (), {"name": "DELTA" if stream else "FINAL_ONLY"})()


class FakeOpenAILayer:
    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @staticmethod
    def _json(body: bytes) -> dict[str, Any]:
        try:
            data = json.loads(body)
        except ValueError:
            raise ApiError(400, "request body is not valid JSON.", param="body") from None
        if not isinstance(data, dict):
            raise bad_request("body must be an object.")
        return data

    def _tokenizer(self, what: str) -> None:
        if not self.engine.facts.tokenizer:
            raise bad_request(f"{what} needs a tokenizer; {NO_TOKENIZER}.")

    async def completions(self, raw: Any, body: bytes, gate: Gate) -> Answer:
        req = self._json(body)
        prompt = req.get("prompt")
        if isinstance(prompt, str):
            self._tokenizer("a text prompt")
            prompt = [ord(c) % 512 for c in prompt]
        prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt]
        for p in prompts:
            check_prompt(p, gate.limits)
        client_id = "cmpl-" + (raw.headers.get("x-request-id") or str(req.get("request_id") or "fake"))
        gate.name(client_id)
        n, stream = int(req.get("n", 1)), bool(req.get("stream"))
        params = _Params(n, int(req.get("max_tokens", 16)), stream)
        ids = [gate.enter(client_id, f"{client_id}-{i}") for i in range(len(prompts))]
        gens = [self.engine.generate(p, params, eid) for p, eid in zip(prompts, ids, strict=True)]
        released: set[str] = set()

        def release() -> None:
            for eid in ids:
                if eid not in released:
                    released.add(eid)
                    gate.leave(eid)

        if stream:
            async def events() -> AsyncIterator[bytes]:
                try:
                    for i, g in enumerate(gens):
                        async for out in g:
                            for o in out.outputs:
                                chunk = {"id": client_id, "choices": [{"index": i * n + o.index, "token_ids":
                                                                       o.token_ids, "finish_reason": o.finish_reason}]}
                                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"
                finally:
                    release()

            return Answer(200, stream=events(), request_id=client_id, engine_ids=ids, close=release)
        try:
            choices = []
            for i, g in enumerate(gens):
                async for out in g:
                    for o in out.outputs:
                        choices.append({"index": i * n + o.index, "token_ids": o.token_ids,
                                        "finish_reason": o.finish_reason})
        finally:
            release()
        return Answer(200, {"id": client_id, "object": "text_completion", "choices": choices}, request_id=client_id,
                      engine_ids=ids)

    async def chat_completions(self, raw: Any, body: bytes, gate: Gate) -> Answer:
        self._tokenizer("chat (the chat template)")
        return Answer(200, {"object": "chat.completion", "choices": []})

    async def render_chat(self, raw: Any, body: bytes) -> Answer:
        self._tokenizer("rendering a chat (the chat template)")
        return Answer(200, {"token_ids": [1, 2, 3]})

    async def tokenize(self, raw: Any, body: bytes) -> Answer:
        self._tokenizer("/tokenize")
        text = str(self._json(body).get("prompt", ""))
        return Answer(200, {"tokens": [ord(c) % 512 for c in text], "count": len(text), "max_model_len": 512})

    async def detokenize(self, raw: Any, body: bytes, limits: Any) -> Answer:
        self._tokenizer("/detokenize")
        return Answer(200, {"prompt": "".join(chr(t) for t in self._json(body).get("tokens", []))})
