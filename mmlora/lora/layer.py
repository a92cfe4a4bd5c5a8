"""LoRALinear: the one wrapper that adds the batch's LoRA deltas to a base linear's output."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mmlora.backends.base import LoRABackend
from mmlora.lora.batch_info import LoRABatchInfo


@dataclass
class LoRAContext:
    """Shared by every LoRALinear of a model; the model runner sets ``info`` around each forward."""

    backend: LoRABackend
    info: LoRABatchInfo | None = None


class LoRALinear(nn.Module):
    """``out = base(x); out += lora(x)``: the base layer's own forward, then the backend's batched delta.

    A [S, n*R, in], B [S, out, R], scalings [S, n] are this module's views into the adapter pool.
    """

    def __init__(
        self,
        base: nn.Linear,
        A: torch.Tensor,
        B: torch.Tensor,
        scalings: torch.Tensor,
        slice_offsets: tuple[int, ...],
        ctx: LoRAContext,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.output_sizes = getattr(base, "output_sizes", (base.out_features,))
        self.A, self.B, self.scalings = A, B, scalings
        self.slice_offsets = slice_offsets
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        info = self.ctx.info
        if info is not None and info.has_lora:
            flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
            self.ctx.backend.add_lora(
                flat_out, flat_x, self.A, self.B, self.scalings, info, self.slice_offsets
            )
        return out
