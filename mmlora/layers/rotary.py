"""Rotary position embeddings (default, linear and llama3 scaling; M-RoPE for Qwen2-VL), cos/sin cached.

One :class:`RotaryEmbedding` serves every layer of a model (:func:`share_rotary`): its cos/sin table is
built once, and the rows of a forward's positions are gathered once, not once per layer. The settings
come typed (:class:`RopeConfig`), read from the HF config once by :mod:`mmlora.models.arch_config`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from mmlora.backends import cpu_kernels
from mmlora.layers.rotary_ops import apply_rotary, rotate_half

__all__ = ["MRotaryEmbedding", "RopeConfig", "RotaryEmbedding", "rotate_half", "share_rotary"]

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary settings of a model, typed (HF's ``rope_theta`` + ``rope_scaling`` or ``rope_parameters``)."""

    theta: float = 10000.0
    """Base of the rotation frequencies (HF ``rope_theta``)."""
    rope_type: str = "default"
    """Frequency scaling: ``default`` (none), ``linear`` or ``llama3`` (HF's ``mrope`` is ``default``)."""
    factor: float = 1.0
    """Scaling factor of ``linear`` and ``llama3``."""
    low_freq_factor: float = 1.0
    """``llama3``: wavelengths above ``original_max_position_embeddings / low_freq_factor`` are scaled."""
    high_freq_factor: float = 4.0
    """``llama3``: wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept."""
    original_max_position_embeddings: int = 8192
    """``llama3``: the context length the model was pretrained at."""
    mrope_section: tuple[int, ...] | None = None
    """M-RoPE (Qwen2-VL): frequency pairs per axis (t, h, w), summing to head_dim / 2; None: plain RoPE."""

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
            )


def _inv_freq(dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    base = float(rope.theta)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = rope.rope_type
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(rope.factor), 1.0
    if rope_type == "llama3":
        factor = float(rope.factor)
        low, high = float(rope.low_freq_factor), float(rope.high_freq_factor)
        old_len = float(rope.original_max_position_embeddings)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise AssertionError(rope_type)  # RopeConfig refuses other types


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, Hq, D] and k [T, Hkv, D] at integer positions [T] (neox layout, as HF)."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = _inv_freq(head_dim, rope)
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
        """(q, k) rotated: ``x * cos + rotate_half(x) * sin`` (one fused kernel on CUDA; on CPU in fp32 /
        bf16 one C call where the CPU kernels are built: :func:`cpu_kernels.rotary`)."""
        cos, sin = self.cos_sin(positions, q.dtype)
        if (
            q.device.type == "cpu"
            and q.dtype == k.dtype
            and q.dtype in cpu_kernels.ELEMENTWISE_DTYPES
            and cpu_kernels.rotary_layout_ok(q, k, cos, sin)
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
            and cpu_kernels.available()
        ):
            return cpu_kernels.rotary_unchecked(q, k, cos, sin)
        return apply_rotary(q, k, cos, sin)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE: positions [3, T] (t, h, w); frequency section i of ``rope.mrope_section`` follows
    axis i. 1-D positions [T] (decode graphs, text-only batches) mean all three axes are equal. The
    per-forward memo of cos/sin and the rotation itself are RotaryEmbedding's; only the gather differs."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        if rope.rope_type != "default":
            raise ValueError(f"rope_type {rope.rope_type!r} is not supported for M-RoPE (default only)")
        if rope.mrope_section is None or sum(rope.mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {rope.mrope_section} must sum to head_dim / 2 = {head_dim // 2}")
        super().__init__(head_dim, max_positions, rope)
        self.section = list(rope.mrope_section)

    def _gather(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 half-width tables: each section picks its axis before the cast to dtype.
        if self._cache is None or self._cache[0].device != positions.device:
            t = torch.arange(self.max_positions, device=positions.device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(positions.device))
            self._cache = (freqs.cos(), freqs.sin())
        bounds = [(sum(self.section[:i]), sum(self.section[: i + 1])) for i in range(len(self.section))]
        out = []
        for table in self._cache:
            if positions.dim() == 1:  # text-only decode: all three axes equal, every section reads the same
                half = table[positions]
            else:
                per_axis = table[positions]  # [3, T, D/2]
                half = torch.cat([per_axis[i % 3, :, lo:hi] for i, (lo, hi) in enumerate(bounds)], dim=-1)
            out.append(torch.cat((half, half), dim=-1).to(dtype))
        return out[0], out[1]


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
