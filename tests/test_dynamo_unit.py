"""No engine: the tiny model's tokenizer, and the translation between Dynamo's request plane and tito's API."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from app.dynamo.wire import BadRequest, CardFacts, completion_usage, error_message, to_dynamo_chunk, to_tito_request
from app.tiny.model import TINY_CONFIG, make_tiny_model
from app.tiny.tokenizer import SPECIAL_TOKENS, TOKENIZER_FILES


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tok")
    return make_tiny_model(root / "a"), make_tiny_model(root / "b", tokenizer=False)


def test_tokenizer_files_match_the_model_config(two_models: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    with_tok, _ = two_models
    tok = AutoTokenizer.from_pretrained(str(with_tok))
    cfg = json.loads((with_tok / "config.json").read_text())
    gen = json.loads((with_tok / "generation_config.json").read_text())
    assert len(tok) <= cfg["vocab_size"] == 512
    assert tok.bos_token_id == cfg["bos_token_id"] == gen["bos_token_id"] == 1
    assert tok.eos_token_id == cfg["eos_token_id"] == gen["eos_token_id"] == 2
    assert tok.pad_token_id == gen["pad_token_id"] == 0
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(len(SPECIAL_TOKENS)))
    text = "Hello, how are you today? The quick brown fox."
    ids = tok.encode(text, add_special_tokens=False)
    assert max(ids) < 512 and tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # merges learned: common words are single ids
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_is_deterministic_and_weights_unchanged(two_models: tuple[Path, Path], tmp_path: Path) -> None:
    with_tok, without = two_models
    again = make_tiny_model(tmp_path / "again")
    a, b, c = _digest(with_tok), _digest(without), _digest(again)
    assert {f: a[f] for f in TOKENIZER_FILES} == {f: c[f] for f in TOKENIZER_FILES}
    assert set(b) == {"config.json", "model.safetensors"}
    assert a["config.json"] == b["config.json"]  # the tokenizer changes nothing the engine reads about the model
    from safetensors.torch import load_file

    wa, wb = load_file(str(with_tok / "model.safetensors")), load_file(str(without / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)
    # An existing tokenizer-less model gains the tokenizer without its weights being rewritten.
    before = (without / "model.safetensors").stat().st_mtime_ns
    make_tiny_model(without)
    assert (without / "tokenizer.json").is_file() and (without / "model.safetensors").stat().st_mtime_ns == before


def test_dynamo_request_to_tito() -> None:
    req = {"token_ids": [5, 6], "model": "m", "eos_token_ids": [2],
           "sampling_options": {"temperature": 0.0, "top_p": None, "seed": 3},
           "stop_conditions": {"max_tokens": 7, "stop_token_ids_hidden": [9], "stop": ["x"]},
           "output_options": {"logprobs": 2}, "routing": {"dp_rank": 1},
           "prefill_result": {"disaggregated_params": {"kv_transfer_params": {"remote_block_ids": [1]}}}}
    body, headers = to_tito_request(req, "rid-1")
    assert body == {"token_ids": [5, 6], "model": "m", "stream": True, "stream_options": {"include_usage": True},
                    "sampling_params": {"temperature": 0.0, "seed": 3, "max_tokens": 7, "stop_token_ids": [2, 9],
                                        "logprobs": 2},
                    "kv_transfer_params": {"remote_block_ids": [1]}}
    assert headers == {"X-Request-Id": "rid-1", "X-data-parallel-rank": "1"}
    # ignore_eos keeps the model's eos out of the stop ids.
    body, _ = to_tito_request({"token_ids": [1], "eos_token_ids": [2], "stop_conditions": {"ignore_eos": True}})
    assert body["sampling_params"] == {"ignore_eos": True}
    with pytest.raises(BadRequest):
        to_tito_request({"token_ids": "nope"})


def test_tito_answers_to_dynamo_chunks() -> None:
    choice = {"index": 0, "token_ids": [7, 8], "finish_reason": "length",
              "logprobs": {"content": [{"token_id": 7, "logprob": -1.5, "top_logprobs": [
                  {"token_id": 7, "logprob": -1.5, "rank": 1}]}, {"token_id": 8, "logprob": -0.5, "top_logprobs": []}]}}
    chunk = to_dynamo_chunk(choice)
    assert chunk["token_ids"] == [7, 8] and chunk["finish_reason"] == "length"
    assert chunk["log_probs"] == [-1.5, -0.5] and chunk["top_logprobs"][0] == [{"token_id": 7, "logprob": -1.5,
                                                                                "rank": 1}]
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {
        "cached_tokens": 32}}
    assert completion_usage(usage) == {**usage}
    assert error_message(400, b'{"error": {"message": "token_ids: out of vocabulary"}}') == \
        "token_ids: out of vocabulary"
    assert error_message(502, b"bad gateway") == "bad gateway"


def test_card_facts_from_server_info() -> None:
    info = {"model": {"served_model_name": "tiny", "path": "/m", "max_model_len": 512, "max_num_seqs": 8,
                      "kv_block_size": 32, "num_kv_blocks": 100, "has_tokenizer": True},
            "parallelism": {"data_parallel_size": 2},
            "features": {"kv_events": {"0": "tcp://*:5557", "1": "tcp://127.0.0.1:5558"}}}
    f = CardFacts.from_server_info(info)
    assert (f.serves_text, f.context_length, f.kv_block_size, f.total_kv_blocks) == (True, 512, 32, 200)
    assert f.kv_events == {0: "tcp://127.0.0.1:5557", 1: "tcp://127.0.0.1:5558"}
    bare = CardFacts.from_server_info({"model": {**info["model"], "has_tokenizer": False}})
    assert not bare.serves_text and bare.kv_events == {} and bare.data_parallel_size == 1
    assert TINY_CONFIG["vocab_size"] == 512
