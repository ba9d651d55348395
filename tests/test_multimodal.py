"""Multimodal rollouts on the tiny Idefics3 (``tito make-tiny-model --vlm``): content_parts and features, side by
side with vLLM's own server (``--enable-scale-out``); media policy, limits and bad input; the prefix cache keyed by
the image. Two engine starts: one tito, one vLLM server (module-scoped)."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.multimodal import (
    NO_MM,
    Features,
    MediaPart,
    MediaPolicy,
    check_unexpanded,
    normalize_features,
    parse_request,
)
from app.core.protocol import ApiError
from app.tiny.vlm import FAKE_ID, GLOBAL_ID, IMAGE_ID, IMAGE_SEQ_LEN, make_tiny_vlm
from tests.conftest import SharedServers, module_server, start_tito
from tests.helpers import ROOT, ServerProcess, engine_env, free_port
from tests.sweep import fire, shapes
from tests.test_generate import sse_events

GEN = "/inference/v1/generate"
TEMPLATE = "<s>User:<image>{text}<end_of_utterance>\nAssistant:"
SP = {"max_tokens": 6, "temperature": 0, "logprobs": 2}
MAX_MEDIA_BYTES = 600_000  # features of one tiny image are ~330 KB of base64
MAX_PIXELS = 200 * 200


def png(color: str, size: tuple[int, int] = (64, 48)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def image_part(color: str) -> dict[str, str]:
    return {"type": "image_url", "url": data_url(png(color))}


# --------------------------------------------------------------------------------------------- unit (no engine)

POLICY = MediaPolicy(max_items=2, max_bytes=10_000, max_pixels=100 * 100)


@pytest.mark.parametrize(("parts", "status", "words"), [
    ([{"type": "image_url", "url": "http://169.254.169.254/x.png"}], 400, "http(s) media URLs are disabled"),
    ([{"type": "image_url", "url": "file:///etc/passwd"}], 400, "file: media URLs are disabled"),
    ([{"type": "image_url", "url": "ftp://h/x.png"}], 400, "unsupported media URL scheme"),
    ([{"type": "image_url", "url": "data:image/png;base64,%%%"}], 400, "malformed base64"),
    ([{"type": "image_url", "url": "data:image/png,abc"}], 400, "data:<media type>;base64"),
    ([{"type": "image_url", "url": data_url(b"not an image")}], 400, "could not be decoded"),
    ([{"type": "image_url", "url": data_url(png("red", (200, 200)))}], 413, "--max-image-pixels"),
    ([{"type": "image_url", "url": data_url(b"x" * 20_000)}], 413, "--max-media-bytes"),
    ([image_part("red")] * 3, 400, "at most 2 media items"),
    ([{"type": "text", "text": "hi"}], 400, "content part type"),
    ([{"type": "image_url"}], 400, "non-empty string url"),
    ([{"type": "image_url", "url": data_url(png("red")), "uuid": ""}], 400, "uuid"),
    ([{"type": "image_url", "url": data_url(png("red"), "audio/wav")}], 400, "does not match"),
])
def test_content_parts_checks(parts: list[Any], status: int, words: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_request([1, IMAGE_ID], parts, None, POLICY, multimodal=True)
    assert e.value.status == status and words in e.value.message, e.value.message


def test_url_policy_flags(tmp_path: Path) -> None:
    img = tmp_path / "a.png"
    img.write_bytes(png("red"))
    policy = MediaPolicy(allowed_media_domains=("media.example",), allowed_local_media_path=str(tmp_path))
    ok = parse_request([IMAGE_ID, IMAGE_ID], [{"type": "image_url", "url": "https://media.example/x.png"},
                                             {"type": "image_url", "url": img.as_uri(), "uuid": "a"}], None,
                       policy, multimodal=True)
    assert ok == [MediaPart("image", "https://media.example/x.png"), MediaPart("image", img.as_uri(), "a")]
    for url, words in (("https://internal.example/x.png", "not in --allowed-media-domains"),
                       ("file:///etc/passwd", "outside --allowed-local-media-path"),
                       (f"file://{tmp_path}/../{tmp_path.name}x/a.png", "outside")):
        with pytest.raises(ApiError, match=words):
            parse_request([IMAGE_ID], [{"type": "image_url", "url": url}], None, policy, multimodal=True)


def _features(**over: Any) -> dict[str, Any]:
    f = {"mm_hashes": {"image": ["h1"]}, "mm_placeholders": {"image": [{"offset": 1, "length": 3}]},
         "kwargs_data": {"image": [base64.b64encode(b"abc").decode()]}}
    f.update(over)
    return f


@pytest.mark.parametrize(("features", "words"), [
    (_features(mm_placeholders={"image": [{"offset": 4, "length": 3}]}), "outside the prompt"),
    (_features(mm_placeholders={"image": [{"offset": 0, "length": 0}]}), "length > 0"),
    (_features(mm_placeholders={"image": []}), "as long as mm_hashes"),
    (_features(mm_placeholders={"video": [{"offset": 1, "length": 3}]}), "same modalities"),
    (_features(kwargs_data=None), "kwargs_data must hold"),
    (_features(kwargs_data={"image": [None]}), "base64 string"),
    (_features(kwargs_data={"image": ["!!notbase64"]}), "malformed base64"),
    (_features(mm_hashes={"image": ["h1", "h2"]}, kwargs_data={"image": ["YWJj", "YWJj"]},
               mm_placeholders={"image": [{"offset": 1, "length": 3}, {"offset": 2, "length": 3}]}), "overlap"),
    (_features(mm_metadata={"image": ["YWJj", None]}), "mm_metadata.image must be a list as long"),
    (_features(mm_metadata={"video": [None]}), "keyed like mm_hashes"),
])
def test_features_checks(features: dict[str, Any], words: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_request([1, 2, 3, 4, 5, 6], None, features, POLICY, multimodal=True)
    assert e.value.status == 400 and words in e.value.message, e.value.message


def test_text_only_model_and_both_forms() -> None:
    with pytest.raises(ApiError, match=NO_MM):
        parse_request([1], [image_part("red")], None, POLICY, multimodal=False)
    with pytest.raises(ApiError, match="mutually exclusive"):
        parse_request([1, IMAGE_ID], [image_part("red")], _features(), POLICY, multimodal=True)
    assert parse_request([1], [], None, POLICY, multimodal=False) is None


def test_expanded_prompt_refused_and_ranges_normalized() -> None:
    expanded = [1, FAKE_ID, GLOBAL_ID] + [IMAGE_ID] * IMAGE_SEQ_LEN + [FAKE_ID, 9]
    with pytest.raises(ApiError, match="already expanded"):
        check_unexpanded(expanded, [MediaPart("image", "data:")], IMAGE_ID)
    check_unexpanded([1, IMAGE_ID, 9], [MediaPart("image", "data:")], IMAGE_ID)
    # A render step's range covers the fake/global tokens too; only the <image> run takes embeddings.
    feats = Features({"image": ["h"]}, {"image": [(1, IMAGE_SEQ_LEN + 3)]}, {"image": ["x"]})
    normalize_features(expanded, feats, {"image": IMAGE_ID})
    mask = feats.is_embed["image"][0]
    assert mask is not None and sum(mask) == IMAGE_SEQ_LEN and mask[:2] == [False, False] and not mask[-1]
    with pytest.raises(ApiError, match="holds no image token"):
        normalize_features(expanded, Features({"image": ["h"]}, {"image": [(0, 2)]}, {"image": ["x"]}),
                           {"image": IMAGE_ID})


# --------------------------------------------------------------------------------------------- real engines


_FILES = threading.Lock()


def vlm_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny VLM and the media directory, written once: by the first of the module's two server starts (started
    ahead, tests/conftest.py) or fixtures to run."""
    root = tmp_path_factory.getbasetemp() / "multimodal"
    vlm, media = root / "tiny-idefics3", root / "media"
    with _FILES:
        if not (root / "written").exists():
            make_tiny_vlm(vlm)
            media.mkdir(parents=True, exist_ok=True)
            (media / "teal.png").write_bytes(png("teal"))
            (root / "written").touch()
    return vlm, media


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vlm_files(tmp_path_factory)[0]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vlm_files(tmp_path_factory)[1]


@module_server("tito-vlm")
def start_tito_vlm(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> ServerProcess:
    vlm, media = vlm_files(tmp_path_factory)
    return start_tito(tmp_path_factory, vlm, "--max-model-len", "512", "--max-media-bytes", str(MAX_MEDIA_BYTES),
                      "--max-image-pixels", str(MAX_PIXELS), "--allowed-local-media-path", str(media),
                      name="tito-vlm")


@module_server("vllm-vlm")
def start_vllm_vlm(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> ServerProcess:
    # Not --tokens-only: multimodal needs the processor.
    vlm, _ = vlm_files(tmp_path_factory)
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(vlm), "--dtype", "float32",
           "--max-model-len", "512", "--enforce-eager", "--gpu-memory-utilization", "0.3", "--port", str(port),
           "--enable-scale-out"]
    return ServerProcess(cmd, port, tmp_path_factory.mktemp("logs") / "vllm-vlm.log", env=engine_env()).start(
        timeout=600)


@pytest.fixture(scope="module")
def tito_vlm(shared_servers: SharedServers) -> ServerProcess:
    return shared_servers.get("tito-vlm")


@pytest.fixture(scope="module")
def vllm_vlm(shared_servers: SharedServers) -> str:
    return shared_servers.get("vllm-vlm").url


@pytest.fixture(scope="module")
def tok(vlm: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(vlm))


def prompt_ids(tok: Any, text: str = "describe") -> list[int]:
    ids: list[int] = tok(TEMPLATE.format(text=text), add_special_tokens=False).input_ids
    return ids


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + GEN, json=body, timeout=300)


def lps(answer: dict[str, Any]) -> list[float]:
    return [e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]]


def same_answer(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert max(abs(x - y) for x, y in zip(lps(a), lps(b), strict=True)) <= 1e-4


@pytest.mark.engine
def test_content_parts_match_vllm(tito_vlm: ServerProcess, vllm_vlm: str, tok: Any) -> None:
    ids = prompt_ids(tok)
    answers: dict[str, list[dict[str, Any]]] = {}
    for color in ("red", "navy"):
        body = {"token_ids": ids, "sampling_params": SP, "content_parts": [image_part(color)], "return_token_ids": True}
        ours, theirs = post(tito_vlm.url, body), post(vllm_vlm, body)
        assert ours.status_code == 200, ours.text
        assert theirs.status_code == 200, theirs.text
        same_answer(ours.json(), theirs.json())
        assert ours.json()["prompt_token_ids"] == theirs.json()["prompt_token_ids"]
        assert ours.json()["mm_placeholders"] == theirs.json()["mm_placeholders"]
        answers[color] = [ours.json(), theirs.json()]
    # The image matters: two images, two different answers (else the comparison above would prove little).
    assert lps(answers["red"][0]) != lps(answers["navy"][0])
    # SSE: the same tokens, mm_placeholders in the first chunk.
    body = {"token_ids": ids, "sampling_params": SP, "content_parts": [image_part("red")], "stream": True}
    events = sse_events(post(tito_vlm.url, body).text)
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    assert chunks[0]["mm_placeholders"] == answers["red"][0]["mm_placeholders"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == answers["red"][0]["choices"][0]["token_ids"]


@pytest.mark.engine
def test_rendered_features_match_content_parts(tito_vlm: ServerProcess, vllm_vlm: str, tok: Any) -> None:
    """vLLM's render step → tito's generate: the same answer as content_parts, though the rendered ranges cover the
    fake/global tokens (vLLM's own engine dies on exactly this request)."""
    chat = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png("red"))}}, {"type": "text", "text": "describe"}]}]}
    rendered = httpx.post(vllm_vlm + "/v1/chat/completions/render", json=chat, timeout=300)
    assert rendered.status_code == 200, rendered.text
    req = rendered.json()
    req = req[0] if isinstance(req, list) else req
    ranges = req["features"]["mm_placeholders"]["image"]
    assert ranges[0]["length"] == IMAGE_SEQ_LEN + 3  # the shape that kills vLLM's engine
    by_features = post(tito_vlm.url, {"token_ids": req["token_ids"], "features": req["features"],
                                      "sampling_params": SP})
    assert by_features.status_code == 200, by_features.text
    by_parts = post(tito_vlm.url, {"token_ids": prompt_ids(tok), "sampling_params": SP,
                                   "content_parts": [image_part("red")]})
    same_answer(by_features.json(), by_parts.json())
    assert by_features.json()["mm_placeholders"] == {"image": ranges}
    # Same tokens but features of the wrong size for their range: 400, not a dead engine.
    short = json.loads(json.dumps(req["features"]))
    short["mm_placeholders"]["image"][0] = {"offset": ranges[0]["offset"] + 3, "length": IMAGE_SEQ_LEN - 2}
    bad = post(tito_vlm.url, {"token_ids": req["token_ids"], "features": short, "sampling_params": SP})
    assert bad.status_code == 400 and "embeddings" in bad.json()["error"]["message"], bad.text
    garbage = json.loads(json.dumps(req["features"]))
    garbage["kwargs_data"]["image"][0] = base64.b64encode(b"\x93garbage").decode()
    bad = post(tito_vlm.url, {"token_ids": req["token_ids"], "features": garbage, "sampling_params": SP})
    assert bad.status_code == 400, bad.text
    again = post(tito_vlm.url, {"token_ids": req["token_ids"], "features": req["features"], "sampling_params": SP})
    same_answer(again.json(), by_parts.json())


@pytest.mark.engine
def test_prefix_cache_keyed_by_image(tito_vlm: ServerProcess, tok: Any) -> None:
    # Longer than one KV block, so whole blocks (holding the image) can be reused.
    ids = prompt_ids(tok, "describe this picture please " * 16)

    def cached(color: str) -> int:
        r = post(tito_vlm.url, {"token_ids": ids, "sampling_params": {"max_tokens": 1},
                                "content_parts": [image_part(color)]})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    first = cached("olive")
    assert cached("olive") > first  # the same image: its blocks come from the cache
    assert cached("purple") == 0  # same tokens, another image: nothing reused


BAD: list[tuple[str, dict[str, Any], int, str]] = [
    ("http", {"content_parts": [{"type": "image_url", "url": "http://127.0.0.1:9/x.png"}]}, 400, "disabled"),
    ("file outside", {"content_parts": [{"type": "image_url", "url": "file:///etc/hostname"}]}, 400, "outside"),
    ("base64", {"content_parts": [{"type": "image_url", "url": "data:image/png;base64,@@"}]}, 400, "base64"),
    ("undecodable", {"content_parts": [{"type": "image_url", "url": data_url(b"GIF89a-broken")}]}, 400, "decoded"),
    ("pixels", {"content_parts": [{"type": "image_url", "url": data_url(png("red", (300, 300)))}]}, 413, "pixels"),
    ("bytes", {"content_parts": [{"type": "image_url", "url": data_url(b"\0" * (MAX_MEDIA_BYTES + 10))}]}, 413,
     "--max-media-bytes"),
    ("audio", {"content_parts": [{"type": "audio_url", "url": data_url(b"RIFF", "audio/wav")}]}, 400, "no audio"),
    ("both", {"content_parts": [image_part("red")], "features": _features()}, 400, "mutually exclusive"),
    ("range outside", {"features": _features(mm_placeholders={"image": [{"offset": 500, "length": 3}]})}, 400,
     "outside the prompt"),
    ("mismatch", {"features": _features(mm_hashes={"image": ["a", "b"]})}, 400, "as long as"),
    ("bad msgpack", {"features": _features(mm_placeholders={"image": [{"offset": 6, "length": 1}]})}, 400,
     "MultiModalKwargsItem"),
]


@pytest.mark.engine
@pytest.mark.parametrize(("name", "extra", "status", "words"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_then_good(tito_vlm: ServerProcess, tok: Any, name: str, extra: dict[str, Any], status: int,
                             words: str) -> None:
    ids = prompt_ids(tok)
    r = post(tito_vlm.url, {"token_ids": ids, "sampling_params": SP, **extra})
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
    ok = post(tito_vlm.url, {"token_ids": ids, "sampling_params": SP, "content_parts": [image_part("red")]})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == SP["max_tokens"], ok.text


@pytest.mark.engine
def test_expanded_ids_refused(tito_vlm: ServerProcess, vllm_vlm: str, tok: Any) -> None:
    body = {"token_ids": prompt_ids(tok), "sampling_params": SP, "content_parts": [image_part("red")],
            "return_token_ids": True}
    expanded = post(vllm_vlm, body).json()["prompt_token_ids"]
    r = post(tito_vlm.url, {**body, "token_ids": expanded})
    assert r.status_code == 400 and "already expanded" in r.json()["error"]["message"], r.text


@pytest.mark.engine
def test_trainer_request_shapes_together_keep_the_engine(tito_vlm: ServerProcess, tok: Any) -> None:
    """The request-shape sweep on the VLM: the text shapes and image requests (a group, prompt logprobs, a stream, two
    images) at once."""
    ids = prompt_ids(tok)
    two = tok(TEMPLATE.replace("<image>", "<image><image>").format(text="compare"), add_special_tokens=False).input_ids
    red, navy = image_part("red"), image_part("navy")
    fire(tito_vlm.url, {**shapes(), **{
        "mm_group": {"token_ids": ids, "content_parts": [red],
                     "sampling_params": {"n": 2, "seed": 5, "temperature": 1.0, "logprobs": 1, "max_tokens": 6}},
        "mm_prompt_logprobs": {"token_ids": ids, "content_parts": [navy],
                               "sampling_params": {"n": 2, "max_tokens": 2, "prompt_logprobs": 1, "seed": 8}},
        "mm_stream": {"token_ids": ids, "content_parts": [red], "stream": True, "sampling_params": SP},
        "mm_two_images": {"token_ids": two, "content_parts": [red, navy], "return_token_ids": True,
                          "sampling_params": {"max_tokens": 4, "temperature": 0.7, "stop_token_ids": [2]}},
    }})


@pytest.mark.engine
def test_client_and_cli_images(tito_vlm: ServerProcess, media_dir: Path, tok: Any) -> None:
    from app.client import TitoClient

    ids = prompt_ids(tok)
    ref = post(tito_vlm.url, {"token_ids": ids, "sampling_params": SP, "content_parts": [image_part("teal")]}).json()
    with TitoClient(tito_vlm.url) as c:
        out = c.generate(ids, SP, images=[media_dir / "teal.png"])
        by_file = c.generate(ids, SP, images=[(media_dir / "teal.png").as_uri()])  # --allowed-local-media-path
    assert out.token_ids == by_file.token_ids == ref["choices"][0]["token_ids"]
    cli = subprocess.run([sys.executable, "-m", "tito", "generate", "--url", tito_vlm.url, "--tokens",
                          ",".join(map(str, ids)), "--max-tokens", "6", "--temperature", "0", "--image",
                          str(media_dir / "teal.png")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.split() == [str(t) for t in ref["choices"][0]["token_ids"]]
