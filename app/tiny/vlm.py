"""A tiny random-weight vision-language model (Idefics3) that vLLM's CPU build serves, made offline.

Idefics3 because its vLLM model file and its transformers processor need no torchvision (the Qwen-VL family does,
and this CPU build has none). Layout: text Llama (hidden 128, 2 layers, head_dim 64), SigLIP vision tower (image
112 px, patch 14) and a pixel-shuffle connector (scale 2) → 16 ``<image>`` tokens per image, image splitting off.
The tokenizer is byte-level (every UTF-8 string encodes) with Idefics3's special tokens, padded to the model's
vocabulary so every id the model can sample decodes. Deterministic from the seed; float32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULT_SEED = 1234
VOCAB = 640
IMAGE_SIZE = 112
# Fixed ids (the spec's layout): pad 0, bos 1, <end_of_utterance> 2 (eos), fake 3, <image> 4, <global-img> 5.
SPECIALS = ["<pad>", "<s>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>"]
ROW_COL = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
FAKE_ID, IMAGE_ID, GLOBAL_ID = 3, 4, 5
IMAGE_SEQ_LEN = 16  # ((112 // 14) ** 2) // (2 ** 2)
# Idefics3's own template, shortened: one user turn may hold images and text.
CHAT_TEMPLATE = (
    "<s>{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def vlm_config() -> Any:
    from transformers import Idefics3Config

    text = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float32"}
    vision = {"model_type": "idefics3_vision", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": IMAGE_SIZE, "patch_size": 14, "num_channels": 3}
    top: dict[str, Any] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
                           "torch_dtype": "float32"}
    return Idefics3Config(text_config=text, vision_config=vision, scale_factor=2, image_token_id=IMAGE_ID, **top)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_tokens = list(pre_tokenizers.ByteLevel.alphabet())
    byte_tokens.sort()
    fixed = SPECIALS + ROW_COL
    filler = [f"<unused_{i}>" for i in range(VOCAB - len(fixed) - len(byte_tokens))]
    vocab = {tok: i for i, tok in enumerate(fixed + byte_tokens + filler)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<end_of_utterance>",
                                   pad_token="<pad>", unk_token=None, model_max_length=512,
                                   extra_special_tokens={"image_token": "<image>"})
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[2:] + ROW_COL + filler})
    assert len(fast) == VOCAB, len(fast)
    return fast


def make_tiny_vlm(out_dir: str | Path, seed: int = DEFAULT_SEED, force: bool = False) -> Path:
    """Write the tiny Idefics3 (weights, config, processor, tokenizer, chat template) into ``out_dir``."""
    import torch
    from transformers import Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    out = Path(out_dir)
    if not force and (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model: Any = Idefics3ForConditionalGeneration(vlm_config())
    model.float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Random init with a wider spread than HF's 0.02, so logits are not flat and images change the answer.
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else p.numel()
                std = 1.0 if "embed_tokens" in name else 0.7 / fan_in ** 0.5
                p.copy_(std * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(out), safe_serialization=True)
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE},
        do_resize=True, do_rescale=True, do_normalize=True, do_pad=True)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=_tokenizer(),
                                  image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(str(out))
    gen_cfg = out / "generation_config.json"
    gen_cfg.write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, indent=2) + "\n")
    return out
