"""Multimodal requests (``content_parts`` and ``features``): every check that needs no engine.

Runs before anything reaches vLLM: URL policy (only ``data:`` URLs unless flags allow http(s) hosts or a local
directory), sizes (items per request, decoded bytes, pixels), base64, list shapes and placeholder ranges. The
engine-side half (loading media with vLLM's own tracker and renderer, decoding feature tensors) is in
``app/engine/multimodal.py``, part of the engine adapter.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from app.core.protocol import ApiError, bad_request

# content_parts "type" → vLLM modality
PART_MODALITIES = {"image_url": "image", "audio_url": "audio", "video_url": "video"}
NO_MM = "this model takes no multimodal input"
MAX_UUID = 256


@dataclass(frozen=True)
class MediaPolicy:
    """What a request may ask the server to load (flags ``--allowed-media-domains`` etc.)."""

    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    max_items: int = 4
    max_bytes: int = 5 * 1024 * 1024
    max_pixels: int = 4096 * 4096

    @classmethod
    def from_settings(cls, settings: Any) -> MediaPolicy:
        return cls(tuple(d.lower() for d in settings.allowed_media_domains or ()),
                   settings.allowed_local_media_path, settings.max_mm_items, settings.max_media_bytes,
                   settings.max_image_pixels)


@dataclass(frozen=True)
class MediaPart:
    modality: str  # image, audio, video
    url: str
    uuid: str | None = None


@dataclass
class Features:
    """A checked ``features`` object; kwargs are still the base64 strings (decoded by the engine adapter)."""

    hashes: dict[str, list[str]]
    placeholders: dict[str, list[tuple[int, int]]]  # (offset, length)
    kwargs_data: dict[str, list[str]]
    # Render's metadata-only subset of each item (e.g. num_patches); merged into the item, as vLLM does.
    metadata: dict[str, list[str | None]] = field(default_factory=dict)
    # Per modality and item: which positions of the range take the item's embeddings (see normalize_features).
    is_embed: dict[str, list[list[bool] | None]] = field(default_factory=dict)


@dataclass
class MultimodalPrompt:
    """What the engine adapter made of a multimodal request: the engine input and what the answer reports."""

    engine_input: Any
    prompt_len: int
    placeholders: dict[str, list[dict[str, int]]]


def _param(i: int, key: str | None = None) -> str:
    return f"content_parts.{i}" + (f".{key}" if key else "")


def parse_request(token_ids: list[int], content_parts: list[Any] | None, features: dict[str, Any] | None,
                  policy: MediaPolicy, multimodal: bool) -> list[MediaPart] | Features | None:
    """Check the request's multimodal keys; None for a text-only request."""
    has_parts, has_features = bool(content_parts), features is not None
    if not has_parts and not has_features:
        return None
    if not multimodal:
        raise bad_request(NO_MM, "features" if has_features else "content_parts")
    if has_parts and has_features:
        raise bad_request("content_parts and features are mutually exclusive: send one of them.", "features")
    if has_parts:
        assert content_parts is not None
        return parse_parts(content_parts, policy)
    assert features is not None
    return parse_features(features, len(token_ids), policy)


def parse_parts(parts: list[Any], policy: MediaPolicy) -> list[MediaPart]:
    if len(parts) > policy.max_items:
        raise bad_request(f"at most {policy.max_items} media items per request (--max-mm-items), got {len(parts)}.",
                          "content_parts")
    out = []
    for i, part in enumerate(parts):
        if not isinstance(part, dict):
            raise bad_request("each content part must be an object with type and url.", _param(i))
        ptype = part.get("type")
        if ptype not in PART_MODALITIES:
            raise bad_request(f"content part type must be one of {sorted(PART_MODALITIES)}, got {ptype!r}.",
                              _param(i, "type"))
        url = part.get("url")
        if url is None and isinstance(part.get(ptype), dict):  # the OpenAI chat shape {"image_url": {"url": ...}}
            url = part[ptype].get("url")
        if not isinstance(url, str) or not url:
            raise bad_request("content part needs a non-empty string url.", _param(i, "url"))
        uuid = part.get("uuid")
        if uuid is not None and (not isinstance(uuid, str) or not 0 < len(uuid) <= MAX_UUID):
            raise bad_request(f"uuid must be a string of 1 to {MAX_UUID} characters.", _param(i, "uuid"))
        modality = PART_MODALITIES[ptype]
        check_url(url, modality, policy, _param(i, "url"))
        out.append(MediaPart(modality, url, uuid))
    return out


def check_url(url: str, modality: str, policy: MediaPolicy, param: str) -> None:
    """The URL policy: data URLs always (size-checked here); http(s) only to allowed hosts; files only under the
    allowed directory. Anything else, e.g. ``file:`` without the flag or ``ftp:``, is refused."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        check_data_url(url, modality, policy, param)
    elif scheme in ("http", "https"):
        host = (urlsplit(url).hostname or "").lower()
        if not policy.allowed_media_domains:
            raise bad_request("http(s) media URLs are disabled on this server (send a data: URL, or start it with "
                              "--allowed-media-domains).", param)
        if host not in policy.allowed_media_domains:
            raise bad_request(f"media host {host!r} is not in --allowed-media-domains.", param)
    elif scheme == "file":
        if not policy.allowed_local_media_path:
            raise bad_request("file: media URLs are disabled on this server (start it with "
                              "--allowed-local-media-path).", param)
        root = Path(policy.allowed_local_media_path).resolve()
        path = Path(unquote(urlsplit(url).path)).resolve()
        if root not in path.parents:
            raise bad_request("file: URL is outside --allowed-local-media-path.", param)
        if not path.is_file():
            raise bad_request("file: URL names no readable file.", param)
        if path.stat().st_size > policy.max_bytes:
            raise ApiError(413, f"media file is larger than --max-media-bytes ({policy.max_bytes}).", param=param)
    else:
        raise bad_request(f"unsupported media URL scheme {scheme or url[:16]!r}: use a data: URL.", param)


def check_data_url(url: str, modality: str, policy: MediaPolicy, param: str) -> None:
    head, sep, payload = url.partition(",")
    if not sep or ";base64" not in head.lower():
        raise bad_request("data URL must look like data:<media type>;base64,<data>.", param)
    media_type = head[5:].split(";", 1)[0].lower()
    if media_type and not media_type.startswith(modality + "/") and media_type != "application/octet-stream":
        raise bad_request(f"data URL media type {media_type!r} does not match a {modality} part.", param)
    # Refuse oversized payloads before decoding them (base64: 4 characters per 3 bytes).
    if len(payload) * 3 // 4 > policy.max_bytes + 3:
        raise ApiError(413, f"media item is larger than --max-media-bytes ({policy.max_bytes} bytes decoded).",
                       param=param)
    raw = b64decode(payload, param)
    if len(raw) > policy.max_bytes:
        raise ApiError(413, f"media item of {len(raw)} bytes is larger than --max-media-bytes ({policy.max_bytes}).",
                       param=param)
    if modality == "image":
        check_image(raw, policy, param)


def b64decode(data: str, param: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("malformed base64.", param) from None


def check_image(raw: bytes, policy: MediaPolicy, param: str) -> None:
    """Decodable, and no more pixels than allowed (checked from the header, before decoding the pixels)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as img:
            w, h = img.size
            if w * h > policy.max_pixels:
                raise ApiError(413, f"image of {w}x{h} pixels exceeds --max-image-pixels ({policy.max_pixels}).",
                               param=param)
            img.load()
    except ApiError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise bad_request(f"image could not be decoded: {e}", param) from None


def parse_features(raw: dict[str, Any], prompt_len: int, policy: MediaPolicy) -> Features:
    """vLLM's ``MultiModalFeatures`` rules (same modalities, parallel lists, sorted non-overlapping ranges inside
    the prompt), with clear messages, plus tito's: every item carries its tensors (``kwargs_data``)."""
    hashes, ranges = raw.get("mm_hashes"), raw.get("mm_placeholders")
    kwargs, meta = raw.get("kwargs_data"), raw.get("mm_metadata")
    if not isinstance(hashes, dict) or not isinstance(ranges, dict):
        raise bad_request("features needs mm_hashes and mm_placeholders objects keyed by modality.", "features")
    if set(hashes) != set(ranges):
        raise bad_request("features.mm_hashes and features.mm_placeholders must name the same modalities.",
                          "features.mm_placeholders")
    if not isinstance(kwargs, dict) or set(kwargs) != set(hashes):
        raise bad_request("features.kwargs_data must hold the tensors of every item, keyed like mm_hashes (this "
                          "server resolves no items from a cache).", "features.kwargs_data")
    if meta is not None and (not isinstance(meta, dict) or set(meta) != set(hashes)):
        raise bad_request("features.mm_metadata must be keyed like mm_hashes.", "features.mm_metadata")
    out = Features({}, {}, {})
    spans: list[tuple[int, int]] = []
    total = 0
    for modality, hs in hashes.items():
        p = f"features.mm_hashes.{modality}"
        if modality not in PART_MODALITIES.values():
            raise bad_request(f"unknown modality {modality!r}.", p)
        if not isinstance(hs, list) or not all(isinstance(h, str) and 0 < len(h) <= MAX_UUID for h in hs):
            raise bad_request(f"mm_hashes.{modality} must be a list of strings of 1 to {MAX_UUID} characters.", p)
        rs, ks = ranges[modality], kwargs[modality]
        if not isinstance(rs, list) or len(rs) != len(hs):
            raise bad_request(f"mm_placeholders.{modality} must be a list as long as mm_hashes.{modality} "
                              f"({len(hs)}).", f"features.mm_placeholders.{modality}")
        if not isinstance(ks, list) or len(ks) != len(hs):
            raise bad_request(f"kwargs_data.{modality} must be a list as long as mm_hashes.{modality} ({len(hs)}).",
                              f"features.kwargs_data.{modality}")
        total += len(hs)
        parsed = []
        for j, r in enumerate(rs):
            rp = f"features.mm_placeholders.{modality}.{j}"
            if not isinstance(r, dict) or not all(type(r.get(k)) is int for k in ("offset", "length")):
                raise bad_request("a placeholder is {offset: int, length: int}.", rp)
            off, length = r["offset"], r["length"]
            if off < 0 or length <= 0:
                raise bad_request("placeholder offset must be >= 0 and length > 0.", rp)
            if off + length > prompt_len:
                raise bad_request(f"placeholder [{off}, {off + length}) lies outside the prompt of {prompt_len} "
                                  "tokens.", rp)
            parsed.append((off, length))
            spans.append((off, off + length))
        for j, k in enumerate(ks):
            kp = f"features.kwargs_data.{modality}.{j}"
            if not isinstance(k, str) or not k:
                raise bad_request("each kwargs_data item must be a base64 string (null items need a cache this "
                                  "server does not share).", kp)
            if len(k) * 3 // 4 > policy.max_bytes + 3:
                raise ApiError(413, f"kwargs_data item is larger than --max-media-bytes ({policy.max_bytes}).",
                               param=kp)
            b64decode(k, kp)  # well-formed; the adapter decodes it again into tensors
        ms = [None] * len(hs) if meta is None else meta[modality]
        if not isinstance(ms, list) or len(ms) != len(hs):
            raise bad_request(f"mm_metadata.{modality} must be a list as long as mm_hashes.{modality} ({len(hs)}).",
                              f"features.mm_metadata.{modality}")
        for j, m in enumerate(ms):
            if m is not None:
                if not isinstance(m, str) or len(m) > policy.max_bytes:
                    raise bad_request("each mm_metadata item must be null or a base64 string.",
                                      f"features.mm_metadata.{modality}.{j}")
                b64decode(m, f"features.mm_metadata.{modality}.{j}")
        out.metadata[modality] = list(ms)
        out.hashes[modality] = list(hs)
        out.placeholders[modality] = parsed
        out.kwargs_data[modality] = list(ks)
    if total > policy.max_items:
        raise bad_request(f"at most {policy.max_items} media items per request (--max-mm-items), got {total}.",
                          "features")
    spans.sort()
    for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False):
        if nxt < end:
            raise bad_request("mm_placeholders must not overlap.", "features.mm_placeholders")
    return out


def check_unexpanded(token_ids: list[int], parts: list[MediaPart], image_token_id: int | None) -> None:
    """content_parts take the chat template's ids with one image token per image; vLLM expands them. Ids that are
    already expanded would be expanded again without any error, so they are refused."""
    if image_token_id is None:
        return
    images = sum(1 for p in parts if p.modality == "image")
    found = sum(1 for t in token_ids if t == image_token_id)
    if found != images:
        hint = (" The prompt looks already expanded (as /tokenize or a render step returns it): send the "
                "unexpanded template ids, or send `features` instead.") if found > images > 0 else ""
        raise bad_request(f"content_parts: token_ids must hold exactly one image token (id {image_token_id}) per "
                          f"image part: {images} image part(s), {found} image token(s).{hint}", "token_ids")


def normalize_features(token_ids: list[int], feats: Features, token_ids_by_modality: dict[str, int]) -> None:
    """Mark, within each placeholder range, the positions that take the item's embeddings: the runs of the model's
    media token (e.g. Idefics3's ``<image>``), as vLLM's own processor marks them for ``content_parts``.

    A render step sends ranges that also cover the tokens around the image (Idefics3: ``<fake_token_around_image>``
    and ``<global-img>``), without that mask; vLLM's engine then tries to put N embeddings into N+3 positions and
    dies. Ranges stay as sent (so answers report them unchanged); a range with no media token is refused."""
    for modality, ranges in feats.placeholders.items():
        tok = token_ids_by_modality.get(modality)
        masks: list[list[bool] | None] = []
        for j, (off, length) in enumerate(ranges):
            if tok is None:
                masks.append(None)
                continue
            mask = [t == tok for t in token_ids[off:off + length]]
            if not any(mask):
                raise bad_request(f"placeholder [{off}, {off + length}) holds no {modality} token (id {tok}).",
                                  f"features.mm_placeholders.{modality}.{j}")
            masks.append(None if all(mask) else mask)
        feats.is_embed[modality] = masks


def check_lengths(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """The expanded prompt must leave room to generate; returns the max_tokens to use (all the room if unset). A
    max_tokens past the context end is the token API's: the engine generates up to the end ("length")."""
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(f"Input length ({prompt_len}, after expanding media) exceeds model's maximum context "
                          f"length ({max_model_len}): no room left to generate a token.", "token_ids")
    return room if max_tokens is None else max_tokens


async def multimodal_prompt(state: Any, req: Any, params: Any, cache_salt: str | None) -> MultimodalPrompt | None:
    """The engine input of a multimodal request (None for a text-only one), built by the engine adapter after the
    checks above; fixes ``params.max_tokens`` for the expanded prompt."""
    engine = state.engine
    policy = MediaPolicy.from_settings(state.settings)
    parsed = parse_request(req.token_ids, req.content_parts, req.features, policy, engine.facts.multimodal)
    if parsed is None:
        return None
    if isinstance(parsed, Features):
        prompt = engine.mm.from_features(req.token_ids, parsed, cache_salt)
    else:
        prompt = await engine.mm.from_parts(req.token_ids, parsed, cache_salt, policy.max_pixels)
    wire = req.sampling_params
    asked = wire.max_tokens if "max_tokens" in wire.model_fields_set else None
    params.max_tokens = check_lengths(prompt.prompt_len, asked, engine.facts.max_model_len)
    return prompt
