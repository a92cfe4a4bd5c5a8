"""RMSNorm as Llama computes it (fp32 statistics, weight applied in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (offset + weight). Gemma uses offset 1 (weight stored as w - 1)."""

    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size) if offset == 0.0 else torch.zeros(hidden_size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            # Gemma multiplies in fp32 before casting back.
            return (xf * (self.offset + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)
