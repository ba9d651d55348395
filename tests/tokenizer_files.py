"""A tiny byte-level BPE tokenizer for a copy of the tiny model, so a gateway that tokenizes itself (smg) can serve
it. Built offline with ``tokenizers``; special tokens first so their ids match the model config (bos 1, eos 2).

Stand-in until the tiny model writes its own tokenizer (issue 15's writer in ``app/tiny/model.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: pad, bos, eos of TINY_CONFIG
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "token in, token out: rollouts for reinforcement learning",
    "a tiny model answers with random words from a tiny vocabulary",
    "hello world, hello tito, hello gateway",
] * 50
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def write_tokenizer(model_dir: Path, vocab_size: int = 512) -> Path:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json into ``model_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    # The corpus yields fewer merges than the model has ids; the model samples any id, and a gateway detokenizes
    # every one, so the rest of the vocabulary is filled with plain added tokens.
    n = tok.get_vocab_size()
    assert n <= vocab_size, n
    tok.add_tokens([f"<w{i}>" for i in range(n, vocab_size)])
    assert tok.get_vocab_size() == vocab_size
    tok.save(str(model_dir / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "pad_token": "<pad>", "model_max_length": 512, "chat_template": CHAT_TEMPLATE}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (model_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return model_dir


def model_with_tokenizer(model_dir: Path, out_dir: Path) -> Path:
    """A copy of ``model_dir`` with the tokenizer written into it."""
    shutil.copytree(model_dir, out_dir)
    return write_tokenizer(out_dir)
