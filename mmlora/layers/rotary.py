"""Rotary position embeddings (default, linear, llama3 and yarn-free dynamic-less variants), cos/sin cached.

One :class:`RotaryEmbedding` serves every layer of a model (:func:`share_rotary`): its cos/sin table is
built once, and the rows of a forward's positions are gathered once, not once per layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mmlora.layers.fused_ops import apply_rotary, rotate_half

__all__ = ["RotaryEmbedding", "rope_parameters", "rotate_half", "share_rotary"]


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings of a HF config, old style (rope_theta + rope_scaling) or new (rope_parameters)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _inv_freq(dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, Hq, D] and k [T, Hkv, D] at integer positions [T] (neox layout, as HF)."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = _inv_freq(head_dim, params)
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies (HF keeps fp32).
        self.inv_freq = inv_freq.float()
        self.max_positions = max_positions
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # (positions, dtype, cos, sin) of the last gather: the layers of one forward share it. Keyed on
        # the positions tensor object (held here, so its id cannot be reused): every forward, and every
        # CUDA graph capture, builds a new positions tensor, so a captured graph gathers for itself.
        self._last: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] in ``dtype`` at positions [T]; the same tensors again for the same positions."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        cos, sin = self._gather(positions, dtype)
        self._last = (positions, dtype, cos, sin)
        return cos, sin

    def _gather(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] at ``positions`` from the cached table (built on first use per device/dtype)."""
        if self._cache is None or self._cache[0].device != positions.device or self._cache[0].dtype != dtype:
            t = torch.arange(self.max_positions, device=positions.device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(positions.device))
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cache = (
                (emb.cos() * self.attention_scaling).to(dtype),
                (emb.sin() * self.attention_scaling).to(dtype),
            )
        return self._cache[0][positions], self._cache[1][positions]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, k) rotated: ``x * cos + rotate_half(x) * sin`` (one fused kernel on CUDA)."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary(q, k, cos, sin)


def share_rotary(layers: nn.ModuleList) -> None:
    """Points every layer's ``self_attn.rotary`` that equals the first layer's (same frequencies, scaling
    and length: all of them in the supported models) at the first layer's: one cos/sin table per model
    and one gather per forward."""
    if len(layers) == 0:
        return
    shared = layers[0].self_attn.rotary
    for layer in layers[1:]:
        mine = layer.self_attn.rotary
        if (
            type(mine) is type(shared)
            and mine.max_positions == shared.max_positions
            and mine.attention_scaling == shared.attention_scaling
            and torch.equal(mine.inv_freq, shared.inv_freq)
        ):
            layer.self_attn.rotary = shared
