"""gate_up's LoRA expand fused into the gated activation that reads gate_up's output.

A LoRA expand is a read-modify-write of its module's whole output. For gate_up that output is the widest
of the layer (2 x intermediate: 28,672 columns in Mistral-7B), and its only reader is the gated activation
(``act(gate) * up``), which reads it anyway. So the SGMV expand of gate_up can run inside that kernel:
each program loads its tile of gate and up, adds ``h @ B[slot].T * scaling`` for its rows' adapter (h from
the shrink's split-K planes, B from the pool), rounds where the expand would have stored, and applies the
activation. gate_up's output is then read once and never written, and one launch is gone.

The result is that of the expand followed by the activation kernel
(:func:`mmlora.layers.fused_ops.silu_and_mul`): the same fp32 sums, rounded to the output dtype at the
same two places; bit for bit under the interpreter, within a few ulp on a GPU (whose dot products may sum
in another order for another tile shape: seen once in fp32). Used for eager steps only: at decode runs
(16-token tiles, CUDA graphs) it measured slower than the two kernels (``TUNING`` below). :class:`~mmlora.backends.triton_sgmv.TritonSGMVBackend` hands out the deferred expand
(``defer_lora``) and the activation calls :func:`sgmv_act_and_mul`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from mmlora.backends.base import DeferredLoRA
from mmlora.backends.triton_common import (
    b_rank_offset,
    cdiv,
    dot_upcast,
    gated_act,
    rank_load_bound,
)
from mmlora.backends.triton_sgmv_kernels import _h_planes, _h_tile, _tile
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights
from mmlora.triton_launch import fast

#: Launch heuristics: the largest token tile (segments are tiled as SGMV's expand tiles them), the column
#: tile and how many of them a program covers (h and the scalings are loaded once per program, B and gate_up
#: streamed through a loop ``stages`` deep), warps per program; ``run_*`` for 16-token tiles (decode runs).
#: ``max_split``: the most split-K planes of h the kernel sums with unrolled loads (all in flight at once);
#: batches whose shrink made more take a loop over the planes. ``runs``: whether batches of 16-token tiles
#: defer at all. H200, Mistral-7B gate_up, rank 16, one layer's shrink + expand + activation against shrink +
#: this kernel (``benchmarks/scripts/act_expand_kernels.py``, 2026-12-04, three rounds,
#: ``benchmarks/results/h200-2026-12-04-session22``): 64 x 4 columns and 4 warps made a 4096-token prefill
#: over 8 adapters 0.69x as long (269 -> 187 us) and a mixed step (128 decode rows grouped by adapter and a
#: 2048-token chunk) 0.80x (173 -> 137 us); at decode runs (B=128 and 256 on 32 adapters) no setting of nine
#: came within 1.12x of the expand + activation (27.2 -> 34.0 us at best), so they keep those.
TUNING = {
    "block_m": 32,
    "block_n": 64,
    "group": 4,
    "warps": 4,
    "stages": 2,
    "max_split": 16,
    "runs": False,
    "run_block_n": 64,
    "run_group": 4,
    "run_warps": 4,
    "run_stages": 3,
}


@triton.jit(do_not_specialize=("SPLIT_K", "M_TILES", "ACT"))
def _sgmv_act_expand_kernel(
    gu_ptr, out_ptr, h_ptr, b_ptr, scal_ptr, seg_indptr_ptr, weight_indices_ptr, ranks_ptr, tile_seg_ptr,
    tile_m0_ptr, N_INTER, R, SPLIT_K, stride_g, stride_o, stride_hs, stride_hm, stride_bs, stride_bp,
    stride_bn, stride_ss, M_TILES, N_TILES, ACT,
    U: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    STAGES: tl.constexpr, MAX_SPLIT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, TILED: tl.constexpr,
):  # fmt: skip
    """For every token t of segment i (slot w = w[i]) and column j < I = N_INTER, with g = gu[t, j],
    u = gu[t, I + j] and, where w >= 0 (rank r = ranks[w]),
    ``g = round(g + h[t, :r] @ B[w, j, :r] * sc[w, 0])``, ``u = round(u + h[t, R:R+r] @ B[w, I+j, :r] * sc[w, 1])``:
    ``out[t, j] = round(round(act(g)) * u)``, act SiLU (ACT 0) or tanh GELU (ACT 1), a runtime flag.

    gu [T, 2I] (fp32/fp16/bf16), out [T, I] same dtype; h [SPLIT_K, >= T, 2R] fp32 split-K planes of the
    shrink (summed here and rounded to B's dtype, as the expand does); B [S, 2I, R] or paged
    [S, R / U, 2I, U] (unpaged: U = 0), scalings [S, 2] fp32. Token tiles as in the SGMV expand (TILED:
    from the tile table). Program (tile, column group): GROUP column tiles of BLOCK_N; where the batch's
    ranks fit one BLOCK_K step, h and the scalings are loaded once for the group. Rows of base-only
    segments get the activation alone.
    """
    pid = tl.program_id(0)
    seg, m0 = _tile(pid // N_TILES, seg_indptr_ptr, tile_seg_ptr, tile_m0_ptr, M_TILES, BLOCK_M, TILED)
    seg_end = tl.load(seg_indptr_ptr + seg + 1)
    if m0 >= seg_end:
        return
    slot = tl.load(weight_indices_ptr + seg)
    n0 = (pid % N_TILES) * (GROUP * BLOCK_N)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < seg_end
    g_rows = gu_ptr + offs_m.to(tl.int64)[:, None] * stride_g
    o_rows = out_ptr + offs_m.to(tl.int64)[:, None] * stride_o
    dtype = out_ptr.dtype.element_ty
    hdt = b_ptr.dtype.element_ty
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < rank_load_bound(rank, R)
    live = kk < rank
    b_gate = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs + b_rank_offset(kk, U, stride_bp)[:, None]
    b_up = b_gate + N_INTER * stride_bn
    lora = slot >= 0
    one_step = rank <= BLOCK_K
    hg = tl.zeros((BLOCK_M, BLOCK_K), dtype=hdt)
    hu = tl.zeros((BLOCK_M, BLOCK_K), dtype=hdt)
    sc_g = 0.0
    sc_u = 0.0
    if lora:
        sc_g = tl.load(scal_ptr + slot * stride_ss)
        sc_u = tl.load(scal_ptr + slot * stride_ss + 1)
        if one_step:
            hg = _h_planes(h_ptr, offs_m, m_ok, kk, k_ok, SPLIT_K, stride_hs, stride_hm, hdt, MAX_SPLIT)
            hu = _h_planes(h_ptr, offs_m, m_ok, R + kk, k_ok, SPLIT_K, stride_hs, stride_hm, hdt, MAX_SPLIT)
    for t in tl.range(0, GROUP, num_stages=STAGES):
        offs_n = n0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N_INTER
        mask = m_ok[:, None] & n_ok[None, :]
        g = tl.load(g_rows + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(g_rows + N_INTER + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        if lora:
            b_mask = n_ok[None, :] & k_ok[:, None]
            cols = offs_n[None, :] * stride_bn
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if one_step:
                bg = tl.where(live[:, None], tl.load(b_gate + cols, mask=b_mask, other=0.0), 0.0)
                bu = tl.where(live[:, None], tl.load(b_up + cols, mask=b_mask, other=0.0), 0.0)
                acc_g = _dot(hg, bg, acc_g, UPCAST, PREC)
                acc_u = _dot(hu, bu, acc_u, UPCAST, PREC)
            else:
                for k0 in range(0, rank, BLOCK_K):
                    kr = k0 + kk
                    kr_ok = kr < rank_load_bound(rank, R)
                    step_mask = n_ok[None, :] & kr_ok[:, None]
                    rows = b_rank_offset(kr, U, stride_bp)[:, None] - b_rank_offset(kk, U, stride_bp)[:, None]
                    bg = tl.where(
                        (kr < rank)[:, None], tl.load(b_gate + rows + cols, mask=step_mask, other=0.0), 0.0
                    )
                    bu = tl.where(
                        (kr < rank)[:, None], tl.load(b_up + rows + cols, mask=step_mask, other=0.0), 0.0
                    )
                    hgs = _h_tile(h_ptr, offs_m, m_ok, kr, kr_ok, SPLIT_K, stride_hs, stride_hm, hdt)
                    hus = _h_tile(h_ptr, offs_m, m_ok, R + kr, kr_ok, SPLIT_K, stride_hs, stride_hm, hdt)
                    acc_g = _dot(hgs, bg, acc_g, UPCAST, PREC)
                    acc_u = _dot(hus, bu, acc_u, UPCAST, PREC)
            # Rounded where the expand stores gate_up, so the activation sees the same values.
            g = (g + acc_g * sc_g).to(dtype).to(tl.float32)
            u = (u + acc_u * sc_u).to(dtype).to(tl.float32)
        tl.store(o_rows + offs_n[None, :], gated_act(g, u, ACT, dtype), mask=mask)


@triton.jit
def _dot(h, b, acc, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """``acc + h @ b`` (operands cast to fp32 first where UPCAST: see :func:`dot_upcast`)."""
    if UPCAST:
        h = h.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(h, b, acc, input_precision=PREC)


def fits_gate_up(gate_up: torch.Tensor, weights: LoRAWeights) -> bool:
    """Whether ``gate_up`` [T, 2I] (unit column stride) is a gate | up output of ``weights``' two equal
    slices, the layout the fused kernel reads."""
    return (
        weights.gated_pair
        and gate_up.dim() == 2
        and gate_up.stride(-1) == 1
        and gate_up.shape[1] == weights.slice_offsets[2]
        and gate_up.dtype == weights.B.dtype
    )


def sgmv_act_and_mul(
    gate_up: torch.Tensor,
    h: torch.Tensor,
    weights: LoRAWeights,
    info: LoRABatchInfo,
    tiles: object,
    R: int,
    act: int,
    block_k: int,
) -> torch.Tensor:
    """``act(gate) * up`` [T, I] of ``gate_up`` [T, 2I] with the batch's LoRA delta added to gate and up
    first (the contract of ``_sgmv_act_expand_kernel``). ``h``: the shrink's planes [SPLIT_K, >= T, 2R];
    ``tiles``: SGMV's token tiles of this batch (``seg``, ``m0``, ``count``, ``m_tiles``, ``tiled``,
    ``block_m``); ``block_k``: ranks per step of the rank loop. Inputs are the caller's to check
    (:func:`fits_gate_up`, the backend's validation)."""
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0 or inter == 0:
        return out
    B, scalings = weights.B, weights.scalings
    if B.dim() == 3:
        b_strides, U = (B.stride(0), 0, B.stride(1)), 0
    else:
        b_strides, U = (B.stride(0), B.stride(1), B.stride(2)), B.shape[-1]
    runs = tiles.block_m <= 16
    block_n = TUNING["run_block_n"] if runs else TUNING["block_n"]
    group = TUNING["run_group"] if runs else TUNING["group"]
    n_tiles = cdiv(inter, block_n * group)
    fast(_sgmv_act_expand_kernel)[(tiles.count * n_tiles,)](
        gate_up, out, h, B, scalings, info.seg_indptr, info.weight_indices, info.ranks, tiles.seg, tiles.m0,
        inter, R, h.shape[0], gate_up.stride(0), out.stride(0), h.stride(0), h.stride(1), *b_strides,
        scalings.stride(0), tiles.m_tiles, n_tiles, act,
        U=U, BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=group, STAGES=TUNING["run_stages"] if runs else TUNING["stages"],
        MAX_SPLIT=TUNING["max_split"], UPCAST=dot_upcast(B.dtype), PREC="ieee" if B.dtype == torch.float32 else "tf32",
        TILED=tiles.tiled, num_warps=TUNING["run_warps"] if runs else TUNING["warps"],
        enable_fp_fusion=True,  # as the activation kernel is built (fma inside act)
    )  # fmt: skip
    return out


class SGMVDeferred(DeferredLoRA):
    """A module's SGMV shrink done (``h``), its expand deferred: :meth:`apply` runs the plain expand
    (``expand``, which validates ``out``), :meth:`act_and_mul` the fused activation over SGMV's token
    ``tiles`` (``check`` validates gate_up as the expand's ``out`` first)."""

    def __init__(
        self,
        h: torch.Tensor,
        weights: LoRAWeights,
        info: LoRABatchInfo,
        R: int,
        tiles: object,
        block_k: int,
        expand: Callable[[torch.Tensor], None],
        check: Callable[[torch.Tensor], None],
    ) -> None:
        self.h, self.weights, self.info, self.R = h, weights, info, R
        self.tiles, self.block_k = tiles, block_k
        self._expand, self._check = expand, check

    def apply(self, out: torch.Tensor) -> None:
        self._expand(out)

    def act_and_mul(self, gate_up: torch.Tensor, act: int) -> torch.Tensor | None:
        if not fits_gate_up(gate_up, self.weights):
            return None
        self._check(gate_up)
        return sgmv_act_and_mul(
            gate_up, self.h, self.weights, self.info, self.tiles, self.R, act, self.block_k
        )
