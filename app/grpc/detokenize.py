"""Text for ``vllm.Inference`` answers: incremental detokenization and stop strings, beside the engine.

tito's engine loads no tokenizer (its HTTP API is tokens only, and vLLM's EOS handling differs with one loaded), but
the Dynamo sidecar's frontend takes the detokenized text from the engine's stream and does not detokenize itself.
So the gRPC inference service decodes the sampled tokens here with the model directory's fast tokenizer, as vLLM's
own incremental detokenizer does (offsets into the ids, primed with the end of the prompt), and
applies stop strings to that text the way vLLM does: matched after ``min_tokens``, cut before the stop string (or
after it with ``include_stop_str_in_output``), with the last ``longest stop - 1`` characters held back until the
stream ends or no stop string can start there.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("tito.detokenize")

# Prompt tokens a stream is primed with: enough for the first output token's text to be decoded in its context
# (a leading space, a character split over tokens) without decoding a long prompt again.
PRIME_TOKENS = 16
# One-token decodes kept per server (each skip_special_tokens setting): a bound on memory for huge vocabularies.
PIECE_CACHE = 1 << 16


class Detokenizer:
    """The model directory's ``tokenizer.json``, loaded once per server."""

    def __init__(self, tokenizer: Any, path: str) -> None:
        self.tokenizer = tokenizer
        self.path = path
        # decode([id]) by skip_special_tokens: what a stream's window decodes as its prefix at almost every step.
        self.pieces: dict[bool, dict[int, str]] = {True: {}, False: {}}

    @classmethod
    def load(cls, model_dir: str) -> Detokenizer | None:
        """None when the directory has no fast tokenizer (then answers carry tokens and no text)."""
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            return None
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(path), path)
        except Exception as e:  # noqa: BLE001 - a broken tokenizer file costs the text, not the server
            log.warning("cannot load %s (gRPC answers will carry no text): %s", path, e)
            return None

    def stream(self, prompt_ids: list[int], *, skip_special_tokens: bool = True, stops: list[str] | None = None,
               include_stop: bool = False, min_tokens: int = 0) -> TextStream:
        return TextStream(self.tokenizer, prompt_ids, skip_special_tokens, stops or [], include_stop, min_tokens,
                          self.pieces[skip_special_tokens])


class TextStream:
    """One sequence's text, token by token."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special: bool, stops: list[str],
                 include_stop: bool, min_tokens: int, pieces: dict[int, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.pieces: dict[int, str] = {} if pieces is None else pieces
        # vLLM's incremental detokenization (its slow path: offsets into the ids, the text between them decoded
        # again), not tokenizers' DecodeStream primed with the prompt: when the primed window decodes with U+FFFD
        # (it starts or ends inside a character, common with byte tokens), DecodeStream's first step returned text
        # of the prompt as output, e.g. a request migrated by Dynamo after k tokens (re-sent as prompt + k tokens)
        # then repeated those k tokens' text.
        self.ids = list(prompt_ids[-PRIME_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.longest = max((len(s) for s in self.stops), default=0)
        # Only the text not sent yet: a stop string can only start there (take holds back its possible start), and
        # a long output's text is not copied again at every token.
        self.pending = ""
        self.tokens = 0
        self.stopped: str | None = None

    def _step(self, token_id: int) -> str | None:
        ids = self.ids
        ids.append(token_id)
        decode = self.tokenizer.decode
        start, end = self.prefix_offset, self.read_offset
        if end - start == 1:
            # The window's prefix is one token after every step that produced text: one decode a token, not two.
            tid = ids[start]
            prefix = self.pieces.get(tid)
            if prefix is None:
                prefix = decode([tid], skip_special_tokens=self.skip_special)
                if len(self.pieces) < PIECE_CACHE:
                    self.pieces[tid] = prefix
        else:
            prefix = decode(ids[start:end], skip_special_tokens=self.skip_special) if end > start else ""
        new = decode(ids[start:], skip_special_tokens=self.skip_special)
        if len(new) <= len(prefix) or new.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        if self.prefix_offset > 64:  # keep the window short
            del ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return new[len(prefix):]

    def add(self, token_ids: list[int]) -> int:
        """Decode ``token_ids``; returns how many of them belong to the output (fewer when one completes a stop
        string: the sequence ends there, ``stopped`` names the string)."""
        for k, tid in enumerate(token_ids):
            self.tokens += 1
            piece = self._step(tid)
            if not piece:
                continue
            start = max(0, len(self.pending) - self.longest + 1)
            self.pending += piece
            if self.stops and self.tokens > self.min_tokens and self._match(start):
                return k + 1
        return len(token_ids)

    def _match(self, start: int) -> bool:
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s, start)) != -1]
        if not hits:
            return False
        i, s = min(hits)
        self.pending = self.pending[:i + len(s)] if self.include_stop else self.pending[:i]
        self.stopped = s
        return True

    def take(self, final: bool) -> str:
        """The text not sent yet; while the sequence runs, without the tail a stop string may still start in."""
        text = self.pending
        if final or self.stopped or self.longest <= 1:
            self.pending = ""
            return text
        end = max(0, len(text) - self.longest + 1)
        self.pending = text[end:]
        return text[:end]
