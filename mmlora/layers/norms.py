"""RMSNorm as Llama computes it (fp32 statistics, weight applied in the input dtype), with the fused
residual add of vLLM's decoder layers; the arithmetic lives in :func:`mmlora.layers.fused_ops.rms_norm`
(and, on CPU where they are built, in :mod:`mmlora.backends.cpu_kernels`)."""

from __future__ import annotations

import torch
from torch import nn

from mmlora.backends import cpu_kernels
from mmlora.layers.fused_ops import rms_norm


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (offset + weight). Gemma uses offset 1 (weight stored as w - 1)."""

    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size) if offset == 0.0 else torch.zeros(hidden_size))
        self.eps = eps
        self.offset = offset

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm(x); with ``residual``, ``(RMSNorm(x + residual), x + residual)`` (the sum in x.dtype).
        One fused kernel on CUDA; on CPU the torch arithmetic (Gemma multiplies in fp32 before casting
        back, Llama casts to the dtype and then multiplies by the weight), or for Llama in fp32 / bf16 the
        same arithmetic in one C call where the CPU kernels are built (:func:`cpu_kernels.rms_norm`)."""
        if self._in_c(x, residual):
            return cpu_kernels.rms_norm_unchecked(x, self.weight, self.eps, residual)
        return rms_norm(x, self.weight, self.eps, self.offset, residual)

    def _in_c(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        w = self.weight
        return (
            x.device.type == "cpu"
            and not self.offset
            and x.dtype == w.dtype
            and x.dtype in cpu_kernels.ELEMENTWISE_DTYPES
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape))
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
            and cpu_kernels.available()
        )

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder layer's entry: ``(RMSNorm(x + residual), x + residual)``, or ``(RMSNorm(x), x)`` for
        the first layer (no residual yet)."""
        if residual is None:
            return self(x), x
        return self(x, residual)
