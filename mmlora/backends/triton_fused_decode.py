"""Fused decode LoRA: shrink and expand in one launch per module, each adapter read once per row run.

:func:`fused_decode_add_lora` is the kernel's function-level API (validated inputs, no allocation), so it
can sit behind any backend interface; ``triton-fused`` registers it for decode-like batches (most
segments one token) and keeps SGMV for the rest.

Rows that share an adapter side by side (the CUDA-graph runner sorts decode rows by slot) form *runs*.
A program owns up to BLOCK_M rows of one run (a *head*: the run's first row, or a row at a multiple of
BLOCK_M) and one column chunk of one slice: it computes that slice's ``h`` for its rows on chip (the
full in_features reduction, rank bounded by the slot's rank), rounds it to x.dtype as PEFT does, and
adds ``h @ B.T * scaling`` to its chunk of the output. Every other program exits at once. So an adapter's
A slice is read from memory once per head (again from L2 by the slice's other chunks) and its B once,
instead of once per row. The grid depends only on the token count and the module shape, and ranks are
read per slot at run time: a CUDA graph captured for a token count is right for any slot and rank mix.

Measured on an H200 (bf16, rank 16, Mistral-7B qkv and gate_up, ``bench kernels --quick``, 2026-12-02,
``benchmarks/results/h200-2026-12-02-session7/call3/kernels``): 1.6-2x slower than BGMV wherever it runs
itself (qkv at 32 distinct rows 28.3 vs 17.7 us, gate_up 60.7 vs 31.8 us), probably because each
column chunk redoes the whole in_features reduction. Again at serving's decode runs (2026-12-05,
``benchmarks/scripts/decode_lora_anatomy.py --backend triton-fused``, 14 launch settings, two rounds,
``benchmarks/results/h200-2026-12-05-session27/``): at best 2.5-3.8x SGMV's two launches (B=72 rows on 24
adapters 150-154 vs 52 us a layer, four projections): one program streaming a whole in_features
reduction is far slower than SGMV's split-K shrink. It stays an option (``lora_backend="triton-fused"``),
not a default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmlora.backends.base import DeferredLoRA
from mmlora.backends.registry import register_backend
from mmlora.backends.triton_common import (
    a_page_args,
    a_row_offset,
    b_page_args,
    b_rank_offset,
    cdiv,
    dot_upcast,
    next_pow2,
    offset_args,
    select_bound,
)
from mmlora.backends.triton_sgmv import TritonSGMVBackend
from mmlora.forward import LoRABatchInfo, LoRAWeights
from mmlora.triton_launch import fast

#: Launch settings: rows per head, columns per program (a slice is split into chunks of this many),
#: column tile inside a chunk, in_features tile, warps, software-pipeline depth of the in_features loop
#: (None: Triton's default). Unmeasured guesses.
TUNING = {"block_m": 16, "chunk": 1024, "block_n": 128, "block_k": 128, "warps": 4, "stages": None}


@triton.jit
def _fused_decode_kernel(
    x_ptr, a_ptr, b_ptr, out_ptr, scal_ptr, token_slots_ptr, ranks_ptr,
    T, in_features, R, stride_xm, stride_as, stride_ap, stride_ar, stride_bs, stride_bp, stride_bn, stride_om,
    stride_ss, o0, o1, o2, o3, o4, CHUNKS_PER_SLICE,
    N_SLICES: tl.constexpr, U: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """For every row t with slot s = ts[t] >= 0 and slice j, r = ranks[s]:
    ``out[t, o[j]:o[j+1]] += round(x[t] @ A[s, j*R : j*R+r].T) @ B[s, o[j]:o[j+1], :r].T * sc[s, j]``.

    x [T, in] (fp32/fp16/bf16), A [S, N_SLICES * R, in] or paged [S, R / U, N_SLICES * U, in], B [S, out, R] or paged [S, R / U, out, U] (x.dtype;
    unpaged: U = 0), scalings [S, N_SLICES]
    fp32, out [T, out] updated in place; h rounded to x.dtype, fp32 accumulation; rows with slot -1 and
    columns of other slices untouched. Program (t, j, c): head row t, slice j, column chunk c.
    """
    pid = tl.program_id(0)
    c = pid % CHUNKS_PER_SLICE
    j = (pid // CHUNKS_PER_SLICE) % N_SLICES
    t = pid // (CHUNKS_PER_SLICE * N_SLICES)
    slot = tl.load(token_slots_ptr + t)
    prev_slot = tl.load(token_slots_ptr + tl.maximum(t - 1, 0))
    is_head = (t == 0) | (prev_slot != slot) | (t % BLOCK_M == 0)
    lo = select_bound(j, o0, o1, o2, o3, o4)
    hi = select_bound(j + 1, o0, o1, o2, o3, o4)
    n_lo = lo + c * CHUNK
    if (slot < 0) | (is_head == 0) | (n_lo >= hi):
        return
    rank = tl.load(ranks_ptr + slot)
    # This head's rows: the run from t on, up to the next multiple of BLOCK_M.
    rows = t + tl.arange(0, BLOCK_M)
    in_block = (rows < T) & (rows // BLOCK_M == t // BLOCK_M)
    same = tl.load(token_slots_ptr + rows, mask=in_block, other=-1) == slot
    row_ok = same & (tl.cumsum((~same).to(tl.int32), axis=0) == 0)
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < rank
    a_base = a_ptr + slot.to(tl.int64) * stride_as + a_row_offset(j, rr, R, U, stride_ap, stride_ar)
    x_base = x_ptr + rows.to(tl.int64) * stride_xm
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < in_features
        xt = tl.load(x_base[:, None] + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_base[None, :] + kk[:, None], mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        h = tl.dot(xt, at, h, input_precision=PREC)
    ht = h.to(b_ptr.dtype.element_ty)  # h in x.dtype, as PEFT keeps it
    if UPCAST:
        ht = ht.to(tl.float32)
    scale = tl.load(scal_ptr + slot * stride_ss + j)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    n_hi = tl.minimum(n_lo + CHUNK, hi)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        nn = n0 + tl.arange(0, BLOCK_N)
        n_ok = nn < n_hi
        bt = tl.load(
            b_base + nn[None, :] * stride_bn + b_rank_offset(rr, U, stride_bp)[:, None],
            mask=n_ok[None, :] & r_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            bt = bt.to(tl.float32)
        acc = tl.dot(ht, bt, input_precision=PREC)
        o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + nn[None, :]
        o_mask = row_ok[:, None] & n_ok[None, :]
        prev = tl.load(o_ptrs, mask=o_mask)
        tl.store(o_ptrs, (prev.to(tl.float32) + acc * scale).to(out_ptr.dtype.element_ty), mask=o_mask)


def fused_decode_add_lora(
    out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo
) -> None:
    """``out += lora(x)`` in one launch (contract in :mod:`mmlora.backends.base`); inputs already validated
    (e.g. by :class:`~mmlora.backends.triton_common.FusedTritonBackend`). Best when rows sharing an
    adapter are adjacent; right for any batch."""
    A, B, scalings, slice_offsets = weights.A, weights.B, weights.scalings, weights.slice_offsets
    n = len(slice_offsets) - 1
    R = weights.rank
    *a_strides, _ = a_page_args(A, n)
    *b_strides, U = b_page_args(B)
    widths = [b - a for a, b in zip(slice_offsets, slice_offsets[1:])]
    chunk = TUNING["chunk"]
    chunks = cdiv(max(widths), chunk)
    T = info.num_tokens
    grid = (T * n * chunks,)
    stages = {} if TUNING["stages"] is None else {"num_stages": TUNING["stages"]}
    fast(_fused_decode_kernel)[grid](
        x, A, B, out, scalings, info.token_slots, info.ranks,
        T, x.shape[1], R, x.stride(0), *a_strides, *b_strides, out.stride(0), scalings.stride(0), *offset_args(slice_offsets), chunks,
        N_SLICES=n, U=U, BLOCK_M=TUNING["block_m"], BLOCK_R=max(16, next_pow2(R)), BLOCK_K=TUNING["block_k"],
        CHUNK=chunk, BLOCK_N=min(TUNING["block_n"], chunk), UPCAST=dot_upcast(x.dtype),
        PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=TUNING["warps"], **stages,
    )  # fmt: skip


@register_backend("triton-fused")
class TritonFusedDecodeBackend(TritonSGMVBackend):
    """The fused decode kernel when most segments are single tokens (decode, decode graphs), SGMV else."""

    graph_layouts = ("rows",)  # the kernel finds runs itself, from token_slots

    def defer_lora(self, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> DeferredLoRA | None:
        return None if self._decode_like(info) else super().defer_lora(x, weights, info)

    @staticmethod
    def _decode_like(info: LoRABatchInfo) -> bool:
        return info.num_tokens < 2 * info.num_segments

    def _fused(
        self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, R: int
    ) -> None:
        if self._decode_like(info):
            fused_decode_add_lora(out, x, weights, info)
        else:
            super()._fused(out, x, weights, info, R)
