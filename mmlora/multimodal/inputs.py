"""ImageInputs: what a request with images keeps from ``add_request`` until it finishes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ImageInputs:
    """A request's images, prepared once (:mod:`mmlora.multimodal.prompt`).

    pixel_values   [N, C * tp * p * p] fp32 CPU patches of all images, in image order
    grid_thw       patch grid (t, h, w) of each image
    spans          (start, length) of each image's ``<|image_pad|>`` run in the prompt
    positions      [3, L] int64 CPU M-RoPE positions of the prompt (:mod:`mmlora.multimodal.mrope`)
    rope_delta     position of prompt index i >= L is i + rope_delta
    features       [sum(length), H] vision features on the device while needed, else None
                   (:mod:`mmlora.multimodal.features` fills and frees them)
    image_hashes   sha256 of each image's patch grid and pixels: the prefix cache's key for its tokens
    """

    pixel_values: torch.Tensor
    grid_thw: list[tuple[int, int, int]]
    spans: list[tuple[int, int]]
    positions: torch.Tensor
    rope_delta: int
    features: torch.Tensor | None = None
    image_hashes: list[bytes] = field(default_factory=list)

    @property
    def image_end(self) -> int:
        """Prompt index just past the last image token."""
        return max(s + n for s, n in self.spans)

    def covers_image(self, start: int, n: int) -> bool:
        """Whether prompt indices start .. start + n - 1 hold an image token."""
        return any(s < start + n and start < s + count for s, count in self.spans)
