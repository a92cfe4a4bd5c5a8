"""The per-forward multimodal inputs of a batch, and the lifecycle of each request's vision features.

A request's features are computed when a prefill chunk first covers one of its image tokens (one vision
tower pass over every such request of the batch), kept on its :class:`ImageInputs` while later chunks
still need rows of them, and dropped once its last image token is prefilled (those rows are then in the
KV cache). A preempted request recomputes its prompt, and with it its features.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmlora.multimodal.inputs import ImageInputs
from mmlora.multimodal.mrope import chunk_positions

# pixels [N, C * tp * p * p], grid (t, h, w) per image -> features [sum(t * h * w) / merge**2, H]
EncodeImages = Callable[[torch.Tensor, list[tuple[int, int, int]]], torch.Tensor]


def batch_inputs(
    chunks: list[tuple[ImageInputs | None, int, int]], encode: EncodeImages, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """For the batch's ``(mm_inputs, start, n)`` chunks in order: M-RoPE positions [3, T] on ``device``,
    the image features of the rows the chunks cover and those rows' indices (None, None without any)."""
    todo = [mm for mm, s, n in chunks if mm is not None and mm.features is None and mm.covers_image(s, n)]
    if todo:
        _encode(todo, encode)
    positions, rows, feats, offset = [], [], [], 0
    for mm, start, n in chunks:
        positions.append(chunk_positions(mm, start, n))
        if mm is not None and mm.covers_image(start, n):
            feat_off = 0
            for s, count in mm.spans:
                lo, hi = max(s, start), min(s + count, start + n)
                if lo < hi:
                    rows.append(torch.arange(offset + lo - start, offset + hi - start))
                    feats.append(mm.features[feat_off + lo - s : feat_off + hi - s])
                feat_off += count
            if start + n >= mm.image_end:
                mm.features = None  # every image row is in the KV cache now
        offset += n
    pos = torch.cat(positions, dim=1).to(device, non_blocking=True)
    if not rows:
        return pos, None, None
    return pos, torch.cat(feats), torch.cat(rows).to(device, non_blocking=True)


def _encode(todo: list[ImageInputs], encode: EncodeImages) -> None:
    """One vision-tower pass over the images of several requests; each keeps its own rows."""
    pixels = torch.cat([mm.pixel_values for mm in todo])
    feats = encode(pixels, [g for mm in todo for g in mm.grid_thw])
    for mm, f in zip(todo, feats.split([sum(n for _, n in mm.spans) for mm in todo])):
        mm.features = f
