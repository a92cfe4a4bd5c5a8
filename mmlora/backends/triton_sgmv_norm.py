"""o_proj's and down_proj's LoRA expand fused into the RMSNorm that reads their output (opt-in, decode).

In a decode graph each LoRA module costs two small launches, each about 5 us whatever its bytes (issue
13: eight a layer, about 0.75 s of a 32-adapter serving run). The outputs of o_proj and down_proj are read
by exactly one op, the next RMSNorm (with the residual add: Llama's post-attention norm and the next
layer's input norm; without it: Gemma2's sandwich norms), which reads the whole row anyway. So the SGMV
expand of these single-slice modules can run inside that norm: one program per row adds
``h @ B[slot].T * scaling`` to its row chunk by chunk (h from the shrink's split-K planes), rounds where
the expand would have stored, adds the residual, stores the sum, and then normalises it exactly as
:func:`mmlora.layers.fused_ops.rms_norm` does. One launch and one read and write of the output fewer.

Each row reads its adapter's B (4096 x 16 bf16 = 128 KB for Mistral-7B) itself, mostly from L2 where
rows share adapters, so the fusion suits decode batches only (``TUNING["norm_max_tokens"]``). Off by
default (``TUNING["norm_expand"]``) until timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmlora.backends.triton_common import (
    b_rank_offset,
    dot_upcast,
    next_pow2,
    rank_load_bound,
    rms_norm_scale,
)
from mmlora.backends.triton_sgmv_kernels import _h_planes
from mmlora.forward.lora import RANK_TILE, LoRABatchInfo, LoRAWeights
from mmlora.triton_launch import fast

#: ``norm_expand``: whether SGMV defers o_proj's and down_proj's expand to the norm at all;
#: ``norm_max_tokens``: the largest batch that does; the column chunk of the expand pass and its loop's
#: depth, warps; ``max_block``: the widest row normalised in one tile (wider outputs are not fused).
#: Unmeasured.
TUNING = {
    "norm_expand": False,
    "norm_max_tokens": 256,
    "block_n": 256,
    "stages": 2,
    "warps": 4,
    "max_split": 16,
    "max_block": 16384,
}


@triton.jit(do_not_specialize=("SPLIT_K",))
def _sgmv_norm_expand_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, h_ptr, b_ptr, scal_ptr, token_slots_ptr, ranks_ptr,
    N, R, SPLIT_K, stride_x, stride_r, stride_y, stride_s, stride_hs, stride_hm, stride_bs, stride_bp, stride_bn,
    stride_ss, eps, offset,
    HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, U: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, MAX_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """For row t with slot w = token_slots[t] (rank r = ranks[w]; -1: no adapter):
    ``x' = round(x[t] + round(h[t, :r]) @ B[w, :, :r].T * sc[w, 0])`` (x itself where w < 0),
    ``s[t] = round(x' + res[t])`` (HAS_RESIDUAL; else s[t] = x'), ``y[t] = RMSNorm(s[t])`` as
    ``fused_ops._rms_norm_kernel`` computes it (one tile of BLOCK >= N columns).

    x, res, s, y [T, N] (one float dtype; y may be the weight's promoted dtype), w [N]; h [SPLIT_K, >= T, R]
    fp32 split-K planes of the shrink (summed and rounded to B's dtype, as the expand does); B [S, N, R] or
    paged [S, R / U, N, U] (unpaged: U = 0), scalings [S, 1] fp32. BLOCK_K covers every rank of the batch.
    """
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + row)
    dtype = x_ptr.dtype.element_ty
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    s_row = s_ptr + row * stride_s
    lora = slot >= 0
    w = tl.maximum(slot, 0)
    rank = tl.load(ranks_ptr + w)
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < rank_load_bound(rank, R)
    live = kk < rank
    # h as row 0 of a 16-row tile (tl.dot's smallest), so the delta is summed as the expand's dot sums it.
    m = tl.arange(0, 16)
    first = m == 0
    h = tl.zeros((16, BLOCK_K), dtype=b_ptr.dtype.element_ty)
    sc = 0.0
    if lora:
        h = _h_planes(h_ptr, row + m, first, kk, k_ok, SPLIT_K, stride_hs, stride_hm,
                      b_ptr.dtype.element_ty, MAX_SPLIT)  # fmt: skip
        sc = tl.load(scal_ptr + w * stride_ss)
    if UPCAST:
        h = h.to(tl.float32)
    b_rows = b_ptr + w.to(tl.int64) * stride_bs + b_rank_offset(kk, U, stride_bp)
    for c0 in tl.range(0, N, BLOCK_N, num_stages=STAGES):
        cols = c0 + tl.arange(0, BLOCK_N)
        ok = cols < N
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        if lora:
            bt = tl.load(
                b_rows[:, None] + cols[None, :] * stride_bn, mask=k_ok[:, None] & ok[None, :], other=0.0
            )
            bt = tl.where(live[:, None], bt, 0.0)  # B's padding past the rank may hold anything
            if UPCAST:
                bt = bt.to(tl.float32)
            acc = tl.dot(h, bt, input_precision=PREC)
            delta = tl.sum(tl.where(first[:, None], acc, 0.0), axis=0)
            x = (x + delta * sc).to(dtype).to(tl.float32)  # rounded where the expand stores
        if HAS_RESIDUAL:
            x = x + tl.load(r_row + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(s_row + cols, x.to(dtype), mask=ok)
    tl.debug_barrier()  # the row's sums, stored by all threads, read back below by others
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    xf = tl.load(s_row + cols, mask=ok, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = rms_norm_scale(xf * inv, w_ptr, cols, ok, offset, dtype, GEMMA)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


def norm_fits(x: torch.Tensor, weights: LoRAWeights, residual: torch.Tensor | None) -> bool:
    """Whether ``x`` [T, N] (unit column stride, and ``residual`` alike) is a single-slice module's
    output this kernel reads: N within one norm tile."""
    n = x.shape[-1]
    return (
        weights.n_slices == 1
        and x.dim() == 2
        and x.stride(-1) == 1
        and n == weights.slice_offsets[1]
        and x.dtype == weights.B.dtype
        and next_pow2(n) <= TUNING["max_block"]
        and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1))
    )


def sgmv_norm_expand(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    residual: torch.Tensor | None,
    h: torch.Tensor,
    weights: LoRAWeights,
    info: LoRABatchInfo,
    R: int,
    rank_bound: int,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(x + delta, weight, eps, offset, residual)`` (the contract of
    ``_sgmv_norm_expand_kernel``; the return of :func:`mmlora.layers.fused_ops.rms_norm`). ``h``: the
    shrink's planes [SPLIT_K, >= T, R]; ``rank_bound``: the batch's rank bucket (at most R). Inputs are the
    caller's to check (:func:`norm_fits`, the backend's validation of the expand's output, and the norm's
    own: ``RMSNorm`` checks x, weight and residual first)."""
    T, N = x.shape
    y_dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty((T, N), dtype=y_dtype, device=x.device)
    s = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return y if residual is None else (y, s)
    r = residual if residual is not None else x
    B = weights.B
    if B.dim() == 3:
        b_strides, U = (B.stride(0), 0, B.stride(1)), 0
    else:
        b_strides, U = (B.stride(0), B.stride(1), B.stride(2)), B.shape[-1]
    block_n = min(TUNING["block_n"], next_pow2(N))
    fast(_sgmv_norm_expand_kernel)[(T,)](
        x, r, weight, y, s, h, B, weights.scalings, info.token_slots, info.ranks,
        N, R, h.shape[0], x.stride(0), r.stride(0), y.stride(0), s.stride(0), h.stride(0), h.stride(1),
        *b_strides, weights.scalings.stride(0), float(eps), float(offset),
        HAS_RESIDUAL=residual is not None, GEMMA=bool(offset), U=U, BLOCK=next_pow2(N), BLOCK_N=block_n,
        BLOCK_K=max(RANK_TILE, next_pow2(rank_bound)), STAGES=TUNING["stages"], MAX_SPLIT=TUNING["max_split"],
        UPCAST=dot_upcast(B.dtype), PREC="ieee" if B.dtype == torch.float32 else "tf32",
        num_warps=TUNING["warps"],
        enable_fp_fusion=False,  # the norm's x^2 rounded before the sum, as fused_ops builds it
    )  # fmt: skip
    return y if residual is None else (y, s)
