"""SGMV's expand over a staged shrink (:mod:`mmlora.lora.stage`): the base GEMM wrote every stage
position's shrink beside the base output, so a decode step's LoRA is this one launch a module."""

from __future__ import annotations

import torch

from mmlora.backends.triton_checks import check_expand_weights
from mmlora.backends.triton_sgmv import _expand_launch
from mmlora.backends.triton_sgmv_kernels import _sgmv_expand_kernel
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights
from mmlora.triton_launch import fast


def staged_expand(
    out: torch.Tensor, h: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, h_pos: torch.Tensor
) -> None:
    """``out[seg, slice] += h[seg, p*n*R + slice*R : .. + r] @ B[slot, slice].T * scalings[slot, slice]``
    with ``p = h_pos[slot]``, for every segment with a slot; h [T, C*n*R] in out's dtype (any row
    stride, unit column stride), h_pos [S] int32, B unpaged [S, out, R]; one launch."""
    if not info.has_lora or info.num_tokens == 0:
        return
    if weights.pages > 1:
        raise ValueError("staged_expand: a paged pool has no staged shrink")
    n, R = weights.n_slices, weights.rank
    if h.dim() != 2 or h.shape[0] < info.num_tokens or h.shape[1] % (n * R) or h.stride(1) != 1:
        raise ValueError(
            f"staged_expand: h must be [>= {info.num_tokens}, C * {n * R}] with unit column stride, "
            f"got {tuple(h.shape)} strides {h.stride()}"
        )
    if h_pos.dtype != torch.int32 or h_pos.numel() < weights.B.shape[0]:
        raise ValueError(f"staged_expand: h_pos must be int32 with an entry per slot, got {h_pos.dtype}")
    check_expand_weights(n * R, h.dtype, weights, info, out)
    grid, args, kwargs = _expand_launch((1, 0, h.stride(0)), weights, info, out.stride(0), R, h_pos=h_pos)
    fast(_sgmv_expand_kernel)[grid](h, weights.B, out, *args[3:], **kwargs)
