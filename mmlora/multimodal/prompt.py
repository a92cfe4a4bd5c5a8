"""Prompts to token ids: text or ids checked once, and, for a vision-language model, images prepared.

:func:`text_prompt_ids` serves text-only models. :class:`ImagePrompts` serves Qwen2-VL at
``add_request``: images are decoded (:mod:`mmlora.multimodal.images`) and preprocessed by transformers'
Qwen2-VL image processor (:mod:`mmlora.multimodal.processor`, loaded on first use); every
``<|image_pad|>`` of the text (usually written ``<|vision_start|><|image_pad|><|vision_end|>``) expands
to its image's merged-patch count; a prompt without placeholders gets one per image in front. The M-RoPE
positions of the whole prompt are computed once (:mod:`mmlora.multimodal.mrope`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

import torch

from mmlora.models.arch_config import VisionConfig
from mmlora.multimodal.images import load_image
from mmlora.multimodal.inputs import ImageInputs
from mmlora.multimodal.mrope import mrope_positions
from mmlora.multimodal.processor import load_image_processor

# One image slot in a text: the pad token, with the vision start/end markers when written.
_SLOT_RE = re.compile(r"(<\|vision_start\|>)?<\|image_pad\|>(<\|vision_end\|>)?")
MAX_IMAGES_PER_REQUEST = 64


def checked_text(tokenizer: Any, prompt: Any) -> str:
    """``prompt`` if it is text this model can tokenize; a ValueError naming the problem otherwise."""
    if not isinstance(prompt, str):
        raise ValueError(f"text: expected a string, got {type(prompt).__name__}")
    if tokenizer is None:
        raise ValueError("text: this model has no tokenizer; give input_ids")
    return prompt


def checked_ids(input_ids: Sequence[Any], vocab_size: int) -> list[int]:
    """``input_ids`` as a list if every id is an integer in [0, vocab_size); a ValueError otherwise."""
    ids = list(input_ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"input_ids: every id must be an integer in [0, {vocab_size})")
    return ids


def tokenize(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def text_prompt_ids(
    tokenizer: Any, prompt: str | None, input_ids: Sequence[int] | None, vocab_size: int
) -> list[int]:
    """The token ids of a text-only prompt: ``prompt`` tokenized, or ``input_ids`` checked."""
    if prompt is not None:
        ids = tokenize(tokenizer, checked_text(tokenizer, prompt))
    else:
        ids = checked_ids(input_ids or [], vocab_size)
    if not ids:
        raise ValueError("prompt: empty")
    return ids


class ImagePrompts:
    """Qwen2-VL's request work: prompt ids with image placeholders expanded, and the request's images."""

    def __init__(self, vision: VisionConfig, vocab_size: int, folder: str | None = None) -> None:
        """``folder``: a checkpoint folder that may hold the image processor (preprocessor_config.json)."""
        self.vision = vision
        self.vocab_size = vocab_size
        self.folder = folder or None
        self.image_processor: Any = None

    def set_image_processor(self, processor: Any) -> None:
        """Use ``processor`` (a transformers Qwen2-VL image processor); its patching must match the tower."""
        v = self.vision
        got = (processor.patch_size, processor.temporal_patch_size, processor.merge_size)
        want = (v.patch_size, v.temporal_patch_size, v.spatial_merge_size)
        if tuple(got) != tuple(want):
            raise ValueError(
                f"image processor patch/temporal/merge sizes {got} do not match the model's {want}"
            )
        self.image_processor = processor

    def _processor(self) -> Any:
        if self.image_processor is None:
            self.set_image_processor(load_image_processor(self.folder, self.vision))
        return self.image_processor

    def prepare_prompt(
        self, tokenizer: Any, prompt: str | None, input_ids: Sequence[int] | None, images: list[Any]
    ) -> tuple[list[int], ImageInputs | None]:
        """Token ids with image placeholders expanded, and the request's prepared images (None: text only)."""
        if len(images) > MAX_IMAGES_PER_REQUEST:
            raise ValueError(f"images: {len(images)} images, more than {MAX_IMAGES_PER_REQUEST} per request")
        pil = [load_image(im, name=f"images[{i}]") for i, im in enumerate(images)]
        ids = self._ids_with_slots(tokenizer, prompt, input_ids, len(pil))
        if not ids:
            raise ValueError("prompt: empty")
        if not pil:
            return ids, None
        try:
            out = self._processor()(images=pil, return_tensors="pt")
        except ValueError as e:  # e.g. an aspect ratio beyond what the processor resizes
            raise ValueError(f"images: cannot preprocess: {e}") from None
        grid = [tuple(int(v) for v in row) for row in out["image_grid_thw"].tolist()]
        merge = self.vision.spatial_merge_size
        counts = [t * h * w // merge**2 for t, h, w in grid]
        pad = self.vision.image_token_id
        expanded, spans = [], []
        k = 0
        for tok in ids:
            if tok == pad:
                spans.append((len(expanded), counts[k]))
                expanded.extend([pad] * counts[k])
                k += 1
            else:
                expanded.append(tok)
        positions, delta = mrope_positions(len(expanded), spans, grid, merge)
        pixels = out["pixel_values"].to(torch.float32).contiguous()
        hashes = [_content_hash(g, p) for g, p in zip(grid, pixels.split([t * h * w for t, h, w in grid]))]
        return expanded, ImageInputs(pixels, grid, spans, positions, delta, image_hashes=hashes)

    def _ids_with_slots(
        self, tokenizer: Any, prompt: str | None, input_ids: Sequence[int] | None, num_images: int
    ) -> list[int]:
        """Prompt ids with one ``image_token_id`` per image slot (expanded later)."""
        v = self.vision
        slot = [v.vision_start_token_id, v.image_token_id, v.vision_end_token_id]
        if prompt is not None:
            # Tokenized piece by piece: the slots become their ids even where the tokenizer would split them.
            pieces = _SLOT_RE.split(checked_text(tokenizer, prompt))  # text, start?, end?, text, ...
            texts, starts, ends = pieces[0::3], pieces[1::3], pieces[2::3]
            slots = len(starts)
            ids: list[int] = []
            if slots == 0:
                ids.extend(slot * num_images)
            for i, piece in enumerate(texts):
                if piece:
                    ids.extend(tokenize(tokenizer, piece))
                if i < slots:
                    ids.extend([v.vision_start_token_id] if starts[i] else [])
                    ids.append(v.image_token_id)
                    ids.extend([v.vision_end_token_id] if ends[i] else [])
        else:
            ids = checked_ids(input_ids or [], self.vocab_size)
            if v.image_token_id not in ids:
                ids = slot * num_images + ids
        found = ids.count(v.image_token_id)
        if found != num_images:
            raise ValueError(
                f"images: the prompt has {found} image placeholder(s) (<|image_pad|>) but {num_images} "
                "image(s) were given; give one placeholder per image, or none to put the images first"
            )
        if any(a == b == v.image_token_id for a, b in zip(ids, ids[1:])):
            raise ValueError(
                "prompt: adjacent image placeholders; separate images with <|vision_end|><|vision_start|>"
            )
        return ids


def _content_hash(grid: tuple[int, int, int], patches: torch.Tensor) -> bytes:
    h = hashlib.sha256(repr(grid).encode())
    h.update(patches.numpy().tobytes())
    return h.digest()
