"""Multimodal inputs for the engine (part of the engine adapter; only ``app/engine/adapter.py`` imports this module).

``content_parts`` go through vLLM's own ``AsyncMultiModalItemTracker`` (media loading, with vLLM's
--allowed-media-domains / --allowed-local-media-path checks) and the engine's renderer (the model's HF processor:
prompt expansion, hashing, processor cache), as vLLM's ``/inference/v1/generate`` does. ``features`` are decoded
with vLLM's msgpack serde and checked against the model before the engine sees them.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from app.core.multimodal import Features, MediaPart, MultimodalPrompt, check_unexpanded, normalize_features
from app.core.protocol import ApiError, bad_request
from app.engine.errors import refused_input

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger("tito.engine")

# Files a multimodal model directory ships besides a tokenizer: without them vLLM cannot process media.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def ships_processor(model_dir: str) -> bool:
    return any(os.path.exists(os.path.join(model_dir, f)) for f in PROCESSOR_FILES)


def engine_kwargs(settings: Any) -> dict[str, Any]:
    """Engine arguments for a multimodal model: load tokenizer + processor, and vLLM's own media-source limits."""
    # A redirect could lead an allowed host's URL to an internal one; vLLM follows redirects unless told not to.
    os.environ.setdefault("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
    kw: dict[str, Any] = {"skip_tokenizer_init": False}
    if settings.allowed_local_media_path:
        kw["allowed_local_media_path"] = settings.allowed_local_media_path
    if settings.allowed_media_domains:
        kw["allowed_media_domains"] = list(settings.allowed_media_domains)
    return kw


def _media_token_ids(hf_config: Any) -> dict[str, int]:
    out = {}
    for modality, keys in (("image", ("image_token_id", "image_token_index")),
                           ("video", ("video_token_id", "video_token_index")),
                           ("audio", ("audio_token_id", "audio_token_index"))):
        for k in keys:
            v = getattr(hf_config, k, None)
            if isinstance(v, int):
                out[modality] = v
                break
    return out


class MultimodalInputs:
    """Builds engine inputs from checked multimodal requests, with the model's processor."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm
        self.model_config = llm.vllm_config.model_config
        self.hf_config = self.model_config.hf_config
        self.media_tokens = _media_token_ids(self.hf_config)
        self.image_token_id = self.media_tokens.get("image")

    async def from_parts(self, token_ids: list[int], parts: list[MediaPart], cache_salt: str | None,
                         max_pixels: int) -> MultimodalPrompt:
        from vllm.inputs import TokensPrompt
        from vllm.renderers.chat_utils import AsyncMultiModalItemTracker

        # Bad media or a prompt the processor cannot place the media in: the client's input, not a fault (what vLLM
        # refuses as input, and what its media loaders raise on bytes they cannot read).
        bad_input: tuple[type[Exception], ...] = (*refused_input(), OSError, KeyError, IndexError)
        for i, p in enumerate(parts):
            if self.media_tokens and p.modality not in self.media_tokens:
                raise bad_request(f"this model takes no {p.modality} input.", f"content_parts.{i}.type")
        check_unexpanded(token_ids, parts, self.image_token_id)
        try:
            tracker = AsyncMultiModalItemTracker(self.model_config)
            parser = tracker.create_parser()
            for p in parts:
                getattr(parser, f"parse_{p.modality}")(p.url, p.uuid)
            mm_data, mm_uuids = await tracker.resolve_items()
            _check_pixels(mm_data, max_pixels)
            prompt = TokensPrompt(prompt_token_ids=list(token_ids))
            if cache_salt is not None:
                prompt["cache_salt"] = cache_salt
            if mm_data:
                prompt["multi_modal_data"] = mm_data
            if mm_uuids:
                prompt["multi_modal_uuids"] = mm_uuids
            (engine_input,) = await self.llm.renderer.render_cmpl_async([prompt])
        except ApiError:
            raise
        except bad_input as e:
            raise bad_request(f"content_parts could not be processed: {e}", "content_parts") from None
        return MultimodalPrompt(engine_input, len(engine_input["prompt_token_ids"]), placeholders_of(engine_input))

    def from_features(self, token_ids: list[int], feats: Features, cache_salt: str | None) -> MultimodalPrompt:
        import torch
        from vllm.entrypoints.scale_out.token_in_token_out.mm_features import merge_mm_kwargs_items
        from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item
        from vllm.inputs import mm_input
        from vllm.multimodal.inputs import MultiModalKwargsItems, PlaceholderRange

        for modality in feats.hashes:
            if self.model_config.get_multimodal_config().get_limit_per_prompt(modality) == 0 or (
                    self.media_tokens and modality not in self.media_tokens):
                raise bad_request(f"this model takes no {modality} input.", f"features.mm_hashes.{modality}")
        normalize_features(token_ids, feats, self.media_tokens)
        items: dict[str, list[Any]] = {}
        ranges: dict[str, list[Any]] = {}
        for modality, encoded in feats.kwargs_data.items():
            decoded = []
            for j, data in enumerate(encoded):
                try:
                    meta = feats.metadata.get(modality, [None] * len(encoded))[j]
                    item = merge_mm_kwargs_items(decode_mm_kwargs_item(data),
                                                 decode_mm_kwargs_item(meta) if meta is not None else None)
                except Exception as e:  # noqa: BLE001 - untrusted bytes: msgspec, torch and numpy all raise their own
                    raise bad_request(f"kwargs_data item is not a serialized MultiModalKwargsItem: {e}",
                                      f"features.kwargs_data.{modality}.{j}") from None
                decoded.append(item)
            items[modality] = decoded
            ranges[modality] = []
            for j, ((off, length), mask) in enumerate(zip(feats.placeholders[modality], feats.is_embed[modality],
                                                          strict=True)):
                embeds = length if mask is None else sum(mask)
                want = self._expected_embeds(modality, decoded[j])
                if want is not None and want != embeds:
                    raise bad_request(f"{modality} item {j} yields {want} embeddings but its placeholder has {embeds} "
                                      f"{modality} token positions.", f"features.mm_placeholders.{modality}.{j}")
                is_embed = None if mask is None else torch.tensor(mask, dtype=torch.bool)
                ranges[modality].append(PlaceholderRange(offset=off, length=length, is_embed=is_embed))
        engine_input = mm_input(prompt_token_ids=list(token_ids), mm_kwargs=MultiModalKwargsItems(items),
                                mm_hashes=feats.hashes, mm_placeholders=ranges, cache_salt=cache_salt)
        return MultimodalPrompt(engine_input, len(token_ids), placeholders_of(engine_input))

    def _expected_embeds(self, modality: str, item: Any) -> int | None:
        """Embeddings the encoder makes for one item, for the models whose count tito knows (Idefics3/SmolVLM:
        patches x image_seq_len); None means not checked."""
        cfg = self.hf_config
        vision = getattr(cfg, "vision_config", None)
        if modality != "image" or getattr(cfg, "model_type", "") not in ("idefics3", "smolvlm") or vision is None:
            return None
        try:
            patches = int(item["num_patches"].data)
            per = (vision.image_size // vision.patch_size) ** 2 // (cfg.scale_factor ** 2)
        except (KeyError, AttributeError, TypeError, ValueError, RuntimeError):
            raise bad_request("image item lacks num_patches (not rendered for this model?).",
                              "features.kwargs_data.image") from None
        return patches * per


def _check_pixels(mm_data: Any, max_pixels: int) -> None:
    """Loaded images (also from http(s) or files, which the request-side check cannot see) stay within the limit."""
    for img in (mm_data or {}).get("image", ()) or ():
        size = getattr(img, "size", None)
        if isinstance(size, tuple) and len(size) == 2 and size[0] * size[1] > max_pixels:
            raise ApiError(413, f"image of {size[0]}x{size[1]} pixels exceeds --max-image-pixels ({max_pixels}).",
                           param="content_parts")


def placeholders_of(engine_input: Any) -> dict[str, list[dict[str, int]]]:
    return {m: [{"offset": int(p.offset), "length": int(p.length)} for p in rs]
            for m, rs in engine_input.get("mm_placeholders", {}).items()}
