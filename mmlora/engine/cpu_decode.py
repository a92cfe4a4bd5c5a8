"""CPU facts the engine chooses by: whether the CPU computes bf16 natively, and so what ``dtype="auto"``
means on CPU.

bf16 halves the weight bytes of a CPU decode step and, where the CPU multiplies bf16 natively (AVX-512
BF16 or AMX-BF16), doubles its dot-product rate (``python -m mmlora.bench cpu`` measures the bf16 / fp32 ratio). Elsewhere
torch converts bf16 to fp32 in software and a step gets slower, so ``auto`` keeps fp32 there.
"""

from __future__ import annotations

import torch

from mmlora.backends.onednn import BF16_FLAGS, cpu_bf16_flags

__all__ = ["BF16_FLAGS", "auto_cpu_dtype", "cpu_bf16_flags"]


def auto_cpu_dtype() -> torch.dtype:
    """``dtype="auto"`` on CPU: bfloat16 where the CPU has native bf16 (:data:`BF16_FLAGS`), else float32."""
    return torch.bfloat16 if cpu_bf16_flags() else torch.float32
