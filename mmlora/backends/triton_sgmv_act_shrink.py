"""down's LoRA shrink fused into the gated activation that writes down's input (SGMV decode runs).

In a decode step the MLP runs gate_up, then ``act(gate) * up``, then down. down's LoRA shrink reads the
activation's output right after it is written, and at serving's decode batches it is the slowest shrink of
a layer: a serial loop over 14,336 in_features per split, 9.3 us against 4.4-6.2 us for the other three
(H200, 72 rows on 24 adapters, session 27). The activation is a kernel of its own (about 2.5 us a layer).
Here one kernel does both: a program covers one segment (a run of at most 16 rows on one adapter) and one
split of the intermediate columns; block by block it computes the activation of its rows, stores it, and
multiplies it by the adapter's A columns, leaving one split-K plane of down's h. down's base GEMM then
reads the activation and down's expand, after it, sums the planes as it sums the plain shrink's.

The values are those of the activation kernel (:func:`mmlora.layers.fused_ops.silu_and_mul`) followed by
SGMV's shrink with the same split of in_features (:func:`mmlora.backends.triton_sgmv._shrink_launch`): the
activation is elementwise with the same formula, rounded at the same places, and h's planes are fp32 sums
of the same products over the same column blocks. Used for decode runs (16-token tiles) only, where
``TUNING["act_shrink"]`` asks; other batches keep the activation and the plain shrink.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmlora.backends.triton_common import ShrinkJob, a_row_offset, gated_act
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights
from mmlora.triton_launch import LaunchPlan, fast


@triton.jit(do_not_specialize=("K_PER_SPLIT", "SPLIT_K", "ACT"))
def _act_shrink_kernel(
    gu_ptr, out_ptr, a_ptr, h_ptr, seg_indptr_ptr, weight_indices_ptr, ranks_ptr,
    N_INTER, R, K_PER_SPLIT, stride_g, stride_o, stride_as, stride_ap, stride_ar, stride_hs, stride_hm,
    SPLIT_K, ACT,
    U: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """For every token t of segment i (rows s[i]:s[i+1], at most BLOCK_M of them) and column j < I = N_INTER:
    ``out[t, j] = round(round(act(gu[t, j])) * gu[t, I + j])`` (act SiLU for ACT 0, tanh GELU for 1, a
    runtime flag), and where the segment's slot w = w[i] >= 0 (rank r = ranks[w]), for split k:
    ``h[k, t, :r] = out[t, Kk] @ A[w, :r, Kk].T`` (fp32; the sum over k is down's shrink of out).

    gu [T, 2I] (fp32/fp16/bf16), out [T, I] same dtype; A [S, R, I] or paged [S, R / U, U, I] (out's dtype;
    unpaged: U = 0); h [SPLIT_K, >= T, >= BLOCK_R] fp32, columns r..BLOCK_R written as zeros, rows of
    base-only segments not written. Program (segment, split): BLOCK_K columns a step over K_PER_SPLIT
    columns. Every row of the batch must lie in a segment (decode runs: ``LoRABatchInfo.fill_rows``).
    """
    pid = tl.program_id(0)
    sp = pid % SPLIT_K
    seg = pid // SPLIT_K
    m0 = tl.load(seg_indptr_ptr + seg)
    seg_end = tl.load(seg_indptr_ptr + seg + 1)
    if m0 >= seg_end:
        return
    slot = tl.load(weight_indices_ptr + seg)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < seg_end
    g_rows = gu_ptr + offs_m.to(tl.int64)[:, None] * stride_g
    o_rows = out_ptr + offs_m.to(tl.int64)[:, None] * stride_o
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    a_base = (
        a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_as + a_row_offset(0, r, R, U, stride_ap, stride_ar)
    )
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_lo = sp * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, N_INTER)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_hi
        mask = m_ok[:, None] & k_ok[None, :]
        g = tl.load(g_rows + kk[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(g_rows + N_INTER + kk[None, :], mask=mask, other=0.0).to(tl.float32)
        act = gated_act(g, u, ACT, out_ptr.dtype.element_ty)
        tl.store(o_rows + kk[None, :], act, mask=mask)
        if slot >= 0:
            at = tl.load(a_base[None, :] + kk[:, None], mask=r_ok[None, :] & k_ok[:, None], other=0.0)
            if UPCAST:
                act = act.to(tl.float32)
                at = at.to(tl.float32)
            acc = tl.dot(act, at, acc, input_precision=PREC)
    if slot >= 0:
        h_ptrs = h_ptr + sp * stride_hs + offs_m[:, None] * stride_hm + r[None, :]
        tl.store(h_ptrs, acc, mask=m_ok[:, None] & (r < R)[None, :])


class ActShrinkPlan:
    """Launch plans for one module shape and activation (``act``) in one forward: the fused kernel's, from
    the plain shrink's launch for the same batch (``shrink_launch``, of a ``job`` whose x is the [T, I]
    activation buffer: the same split, rank tile and column blocks), and the expand's (``expand``)."""

    __slots__ = ("launch", "h_shape", "expand")

    def __init__(
        self, job: ShrinkJob, shrink_launch: tuple, gate_up_stride: int, act: int, expand: LaunchPlan
    ) -> None:
        (programs,), args, kwargs, self.h_shape, _ = shrink_launch
        x, A, info = job.x, job.A, job.info
        # The plain shrink's positional arguments (``_sgmv_shrink_kernel``'s order): in_features, R,
        # K_PER_SPLIT, x's row stride, A's three strides, h's plane and row strides, M_TILES, R_TILES, SPLIT_K.
        in_f, R, k_per_split, _, *a_strides, plane, row, _, r_tiles, split = args[8:20]
        assert r_tiles == 1 and not kwargs["TILED"]  # fits() declines other batches
        launch_args = (
            None, None, A, None, info.seg_indptr, info.weight_indices, info.ranks,
            in_f, R, k_per_split, gate_up_stride, x.stride(0), *a_strides, plane, row, split, act,
        )  # fmt: skip
        launch_kwargs = dict(
            U=kwargs["U"], BLOCK_M=kwargs["BLOCK_M"], BLOCK_R=kwargs["BLOCK_R"], BLOCK_K=kwargs["BLOCK_K"],
            UPCAST=kwargs["UPCAST"], PREC=kwargs["PREC"], num_warps=kwargs["num_warps"],
            enable_fp_fusion=True,  # as the activation kernel is built (fma inside act)
        )  # fmt: skip
        self.launch: LaunchPlan = fast(_act_shrink_kernel).plan(
            (programs,), launch_args, launch_kwargs, (0, 1, 2, 3)
        )
        self.expand = expand

    @staticmethod
    def fits(shrink_launch: tuple) -> bool:
        """Whether the plain shrink's launch is one the fused kernel can take: one rank tile, and segments
        of at most one token tile (decode runs), so a program's rows are its segment's."""
        _, args, kwargs, _, _ = shrink_launch
        return args[18] == 1 and not kwargs["TILED"] and kwargs["BLOCK_M"] <= 16


def act_shrink(
    gate_up: torch.Tensor, out: torch.Tensor, A: torch.Tensor, plan: ActShrinkPlan
) -> torch.Tensor:
    """``out [T, I] = act(gate) * up`` of ``gate_up`` [T, 2I] and down's h planes [SPLIT_K, T padded to 16, R]
    (fp32, returned) in one launch of ``plan`` (the contract of ``_act_shrink_kernel``). Inputs are the
    caller's to check."""
    h = torch.empty(plan.h_shape, dtype=torch.float32, device=gate_up.device)
    fast(_act_shrink_kernel).launch_plan(plan.launch, (gate_up, out, A, h))
    return h


def fits_act_shrink(gate_up: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> bool:
    """Whether ``gate_up`` [T, 2I] (unit column stride, the pool's dtype) feeds a one-slice module of
    in_features I, in a batch whose every row lies in a segment."""
    return (
        weights.n_slices == 1
        and gate_up.dim() == 2
        and gate_up.stride(-1) == 1
        and gate_up.shape[0] == info.num_tokens
        and gate_up.shape[1] == 2 * weights.A.shape[-1]
        and gate_up.dtype == weights.A.dtype
        and sum(info.seg_lens_host) == info.num_tokens
    )
