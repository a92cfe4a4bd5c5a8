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
    """``out[seg, slice] += h[seg, cols] @ B[slot, slice].T * scalings[slot, slice]`` for every segment with a
    slot, its columns at ``p = h_pos[slot]``: unpaged (B [S, out, R]) ``p*n*R + slice*R : .. + r``; paged by
    U ranks (B [S, R/U, out, U]) page-major, rank k of the slice at ``(p + k//U)*n*U + slice*U + k%U`` (the
    order of the staged A's rows). h [T, positions * n * (U or R)] in out's dtype (any row stride, unit
    column stride), h_pos [S] int32; one launch."""
    if not info.has_lora or info.num_tokens == 0:
        return
    n, width = weights.n_slices, weights.n_slices * weights.page_rank  # the columns of one position
    if h.dim() != 2 or h.shape[0] < info.num_tokens or h.shape[1] % width or h.stride(1) != 1:
        raise ValueError(
            f"staged_expand: h must be [>= {info.num_tokens}, positions * {width}] with unit column stride, "
            f"got {tuple(h.shape)} strides {h.stride()}"
        )
    if h_pos.dtype != torch.int32 or h_pos.numel() < weights.B.shape[0]:
        raise ValueError(f"staged_expand: h_pos must be int32 with an entry per slot, got {h_pos.dtype}")
    check_expand_weights(n * weights.rank, h.dtype, weights, info, out)
    grid, args, kwargs = _expand_launch(
        (1, 0, h.stride(0)), weights, info, out.stride(0), weights.rank, h_pos=h_pos
    )
    fast(_sgmv_expand_kernel)[grid](h, weights.B, out, *args[3:], **kwargs)
