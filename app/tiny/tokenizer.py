"""A tokenizer for the tiny model, built offline with the ``tokenizers`` package (byte-level BPE).

tito itself never loads it (the engine runs tokens-only); it is there for what sits in front of tito and speaks
text: Dynamo's frontend (chat and completions), transformers' ``AutoTokenizer``, a trainer's renderer. Special
tokens come first so their ids are small and match the model's config (bos 1, eos 2, pad 0); the byte alphabet
and merges learned from a fixed corpus fill the rest, never past the model's 512 ids. Same inputs, same files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Order is the id: pad 0, bos 1, eos 2 (config.json's bos_token_id/eos_token_id), then the chat markers.
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# ChatML, as Qwen models use it; generation stops on eos (the only stop id the model config declares).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

# The merges are learned from this text (plain English plus chat-ish words), so common words become single ids.
_CORPUS = """\
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Complex is better than complicated. Flat is better than nested. Sparse is better than dense.
Readability counts. Special cases aren't special enough to break the rules. Although practicality beats purity.
Errors should never pass silently. Unless explicitly silenced. In the face of ambiguity, refuse the temptation to
guess. There should be one-- and preferably only one --obvious way to do it. Now is better than never.
If the implementation is hard to explain, it's a bad idea. If the implementation is easy to explain, it may be a
good idea. Namespaces are one honking great idea -- let's do more of those!
The quick brown fox jumps over the lazy dog. A tiny model answers every question with random tokens.
user assistant system Hello, how are you today? I am fine, thank you. What is the capital of France? Paris.
Tell me a story about a robot who learns to paint. Once upon a time there was a small robot in a big city.
The weather is nice and the sun is shining. Please write a short poem about the sea and the stars at night.
Count from one to ten: one two three four five six seven eight nine ten. 0123456789 + - * / = ( ) [ ] { }
def main(): return print("hello world") for i in range(10): if x is None: continue else: break
"""


def build_tokenizer(vocab_size: int = 512) -> Any:
    """Train the byte-level BPE (``tokenizers.Tokenizer``); at most ``vocab_size`` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    lines = _CORPUS.splitlines()
    tok.train_from_iterator(lines * 8, trainer=trainer, length=len(lines) * 8)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    assert tok.get_vocab_size() <= vocab_size
    return tok


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(out_dir: str | Path, config: dict[str, Any]) -> Path:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and generation_config.json beside a
    model whose ``config`` (config.json) declares bos/eos; each file is written to a temporary name and renamed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for key in ("bos_token_id", "eos_token_id"):
        if config.get(key) != SPECIAL_IDS[key]:
            raise ValueError(f"config.json {key}={config.get(key)!r}, the tokenizer has {SPECIAL_IDS[key]}")
    tok = build_tokenizer(int(config["vocab_size"]))
    files: dict[str, str] = {
        "tokenizer.json": tok.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(tokenizer_config(int(config["max_position_embeddings"])), indent=2),
        "special_tokens_map.json": json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2),
        # Only the special ids: no sampling defaults, so what vLLM derives from it equals what config.json gave.
        "generation_config.json": json.dumps(SPECIAL_IDS, indent=2),
    }
    for name, text in files.items():
        tmp = out / (name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(out / name)
    return out
