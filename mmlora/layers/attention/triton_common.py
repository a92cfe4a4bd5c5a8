"""Pieces shared by the Triton attention kernels: score scaling with soft-capping, dot precision."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh from exp2 (no tl.tanh in every Triton version, and the interpreter must run it too);
    # saturates cleanly to +-1 when exp2 overflows or underflows.
    e = tl.exp2(x * 2.8853900817779268)  # exp(2x)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def scale_scores(s, mult, cap_mult, USE_SOFTCAP: tl.constexpr):
    """Raw q.k -> base-2 logits: ``s * scale * log2(e)``, or ``cap * tanh(s * scale / cap) * log2(e)``.

    The host passes ``mult = scale * log2(e)`` without soft-capping, else ``mult = scale / cap`` and
    ``cap_mult = cap * log2(e)``.
    """
    if USE_SOFTCAP:
        return _tanh(s * mult) * cap_mult
    return s * mult


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether the kernels cast ``tl.dot`` operands to fp32: under the interpreter, whose bf16 dot
    returns garbage (triton 3.9); on a GPU fp16/bf16 go to the tensor cores as they are."""
    return interpreting() and dtype != torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands are multiplied exactly (no TF32), so fp32 results match the reference tightly."""
    return "ieee" if dtype == torch.float32 or dot_upcast(dtype) else "tf32"


def softmax_args(scale: float, logit_softcap: float | None) -> tuple[float, float]:
    """The (mult, cap_mult) pair ``scale_scores`` expects."""
    log2e = 1.4426950408889634
    if logit_softcap:
        return scale / logit_softcap, logit_softcap * log2e
    return scale * log2e, 0.0
