"""triton-bgmv: per-token gather matrix-vector kernels (Punica's BGMV), built for memory-bound decode.

Each token reads its own adapter through ``info.token_slots``, so any batch is right (prefill too,
with each token re-reading its adapter). Decode with many distinct adapters is a stream over adapter
weights, so the kernels are elementwise multiply-and-reduce tiles with wide contiguous loads rather
than ``tl.dot``:

- shrink splits ``in_features`` across programs (split-K) so even a handful of tokens fills the GPU;
  each split writes fp32 partial sums to its own plane of a [SPLIT_K, T, n*R] buffer (no atomics, no
  memset, deterministic);
- expand sums the partial planes for its token while loading them (they are tiny and L2-resident),
  rounds ``h`` to x.dtype as PEFT does, and streams B over all slices of the packed output at once.

Both walk the rank in tiles of ``RANK_TILE`` (16): shrink's grid has one program per rank tile up to
the batch's rank bound (``info.rank_bound``) and a program past its slot's rank returns at once;
expand loops over its slot's rank tiles only. So a rank-8 slot in a rank-64 pool costs one tile,
never the pool's 64 (issue 23). Grids depend only on host ints (``num_tokens``, the rank bound,
shapes), so a CUDA graph captured for a (token count, rank bound) stays right for any mix of slots
and ranks below the bound replayed into the same LoRABatchInfo.

Compile-time constants depend on the module shape, the dtype, the pool rank and, for the expand's
rank tile and column tile, the batch's rank bucket (``info.rank_bound``: a rank-16 batch of a rank-64
pool runs the rank-16 pool's tiles): the split of in_features and the tile counts are run-time
arguments (never specialised), and the partial planes are padded to 16 rows so their stride keeps its
divisibility. So a module shape compiles once per rank bucket, and the warm-up
(:mod:`mmlora.backends.warmup`) runs every bucket before serving (issue 23: compiles inside timed runs
stalled every request in flight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mmlora.backends.registry import register_backend
from mmlora.backends.triton_checks import check_expand_args
from mmlora.backends.triton_common import (
    FusedTritonBackend,
    ShrinkJob,
    a_page_args,
    a_row_offset,
    b_page_args,
    b_rank_offset,
    cdiv,
    next_pow2,
    offset_args,
    pdl_launch,
    pdl_options,
    rank_bucket_bound,
    rank_load_bound,
    shrink_entry,
    slice_bound,
    split_k_plan,
)
from mmlora.forward.lora import RANK_TILE, LoRABatchInfo, LoRAWeights
from mmlora.triton_launch import LaunchPlan, fast

#: Launch heuristics (read at every launch, so a benchmark can sweep them): elements per register
#: tile of shrink and expand, warps per program, expand's per-slice reduction (else one selected h
#: tile), the most splits of in_features, and how many programs per SM shrink aims for. On an H200
#: (bf16, rank 16, Mistral-7B shapes, 2026-11-30) 8 warps, larger tiles and up to 64 splits were no
#: faster; the per-slice reduction was up to 12% faster on packed outputs at 32 tokens. One expand warp
#: and two shrink warps (``benchmarks/scripts/lora_tuning_sweep.py``, 2026-12-02) made decode rows on
#: distinct adapters 0.78x as long at B=32, 0.70x at 64 and 0.67x at 128 (234 -> 158 us over the four
#: projections), and left B=8 unchanged: expand's many small programs stream B faster one warp each.
TUNING = {
    "shrink_tile": 8192,
    "shrink_warps": 2,
    "expand_tile": 4096,
    "expand_warps": 1,
    "expand_per_slice": True,
    "max_split_k": 16,
    "waves": 4,
    # Ranks per step of the expand's loop (None: RANK_TILE), capped by the pool rank (a power of two).
    # H200, decode rows on 32 rank-64 adapters (benchmarks/scripts/decode_lora_anatomy.py, 2026-12-03,
    # two rounds): 32 made B=32 0.92x as long (160 -> 147 us over the four projections) and B=128
    # 0.99-1.0x; 64 was slower at B=128 (1.08-1.11x).
    "expand_rank_tile": 32,
    # The expand as a programmatic dependent launch of its shrink (Hopper+). H200, decode graphs on 32
    # rank-16 adapters (benchmarks/scripts/lora_pdl_ab.py, 2026-12-03, two rounds): B=64 and 128 (SGMV
    # runs) 0.95-0.97x the replay time, B=32 (BGMV, side-stream split: unchanged) 0.99-1.0x; same tokens.
    "pdl": True,
    # Sum the shrink's split-K planes into h (x.dtype) with one torch reduction before the expand, so each
    # expand program loads one plane instead of summing all of them (every program of a token repeats that
    # sum). Off: H200, decode rows on 32 adapters (benchmarks/results/h200-2026-12-03-session17, c1, two
    # rounds), rank 16 1.17-1.48x as long (B=32 52 -> 77 us), rank 64 1.05x at B=32 and 0.92-0.96x at B=128.
    "reduce_partials": False,
}


#: Integer arguments that change with the batch: compiled generically (Triton would otherwise build a
#: variant for the value 1 inside a serving run).
_SHRINK_BATCH_INTS = ("SPLIT_K", "R_TILES")
_EXPAND_BATCH_INTS = ("SPLIT_K",)


@triton.jit(do_not_specialize=_SHRINK_BATCH_INTS)
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, p_ptr, token_slots_ptr, ranks_ptr,
    in_features, R, K_PER_SPLIT, stride_xm, stride_as, stride_ap, stride_ar, stride_ps, stride_pm, SPLIT_K,
    R_TILES, N_SLICES: tl.constexpr, NS_P2: tl.constexpr, SKIP_PAD: tl.constexpr, U: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Shrink partials: for token t with slot s = ts[t] >= 0 and split k:
    ``P[k, t, :] = x[t, Kk] @ A[s, :, Kk].T`` over the split's columns Kk of in_features.

    x [T, in] (fp32/fp16/bf16), A [S, N_SLICES * R, in] or paged [S, R / U, N_SLICES * U, in] (x.dtype; unpaged: U = 0),
    P [SPLIT_K, T, N_SLICES * R] fp32.
    Only columns below ranks[s] of each slice (all columns when not SKIP_PAD) of rows with a slot
    are written; the caller zero-fills P when it needs the rest. Program (t, k, rt) covers rank tile rt
    (BLOCK_R ranks of every slice); R_TILES tiles cover the batch's rank bound.
    """
    if PDL:  # the expand (a programmatic dependent) may start now; it waits before reading P
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    rt = pid % R_TILES
    sp = (pid // R_TILES) % SPLIT_K
    t = pid // (R_TILES * SPLIT_K)
    slot = tl.load(token_slots_ptr + t)
    if slot < 0:
        return
    if SKIP_PAD:
        rank = tl.load(ranks_ptr + slot)
    else:
        rank = R
    if rt * BLOCK_R >= rank:
        return
    j = tl.arange(0, NS_P2 * BLOCK_R)
    r = rt * BLOCK_R + j % BLOCK_R
    col = (j // BLOCK_R) * R + r
    w_ok = (j // BLOCK_R < N_SLICES) & (r < rank)
    a_base = a_ptr + slot.to(tl.int64) * stride_as + a_row_offset(j // BLOCK_R, r, R, U, stride_ap, stride_ar)
    x_base = x_ptr + t.to(tl.int64) * stride_xm
    k_lo = sp * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, in_features)
    acc = tl.zeros((NS_P2 * BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:  # every split is whole BLOCK_K tiles: no column mask, so loads stay wide
            xv = tl.load(x_base + kk).to(tl.float32)
            av = tl.load(a_base[:, None] + kk[None, :], mask=w_ok[:, None], other=0.0)
        else:
            k_ok = kk < k_hi
            xv = tl.load(x_base + kk, mask=k_ok, other=0.0).to(tl.float32)
            av = tl.load(a_base[:, None] + kk[None, :], mask=w_ok[:, None] & k_ok[None, :], other=0.0)
        acc += av.to(tl.float32) * xv[None, :]
    tl.store(p_ptr + sp * stride_ps + t.to(tl.int64) * stride_pm + col, tl.sum(acc, axis=1), mask=w_ok)


@triton.jit(do_not_specialize=_EXPAND_BATCH_INTS)
def _bgmv_expand_kernel(
    p_ptr, b_ptr, out_ptr, scal_ptr, token_slots_ptr, ranks_ptr,
    R, N_OUT, stride_ps, stride_pm, stride_bs, stride_bp, stride_bn, stride_om, stride_ss, o0, o1, o2, o3, o4,
    N_TILES, SPLIT_K, SPLIT_P2: tl.constexpr, N_SLICES: tl.constexpr, U: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, H_DTYPE: tl.constexpr, PER_SLICE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Expand over all slices: for token t with slot s = ts[t] >= 0, slice j, h = sum_k P[k]:
    ``y[t, o[j]:o[j+1]] += h[t, j*R:j*R+r] @ B[s, o[j]:o[j+1], :r].T * sc[s, j]``, r = ranks[s].

    P [SPLIT_K, T, N_SLICES * R] (fp32 partials, or h itself with SPLIT_K = 1), B [S, N_OUT, R] or paged [S, R / U, N_OUT, U]
    (unpaged: U = 0),
    scalings [S, N_SLICES] fp32, out [T, N_OUT] updated in place. h is rounded to H_DTYPE (x.dtype)
    before use, as PEFT computes it; fp32 accumulation. A program covers BLOCK_N output columns of one
    token, which may straddle slices, and loops over its slot's rank in BLOCK_R tiles. SPLIT_P2 (a power
    of two >= SPLIT_K, fixed per engine) sizes the partial-plane tile. PDL: launched as a programmatic
    dependent of the shrink, it waits for it only before reading P (its B and out loads go first).
    """
    pid = tl.program_id(0)
    nt = pid % N_TILES
    t = pid // N_TILES
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N_OUT
    o_ptrs = out_ptr + t.to(tl.int64) * stride_om + offs_n
    slot = tl.load(token_slots_ptr + t)
    prev = tl.load(o_ptrs, mask=n_ok)  # issued early: its latency overlaps the slot-dependent loads
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    bound = rank_load_bound(rank, R)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + offs_n * stride_bn
    p_base = p_ptr + t.to(tl.int64) * stride_pm
    sp = tl.arange(0, SPLIT_P2)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        r_ok = rr < rank
        # Loads stop at rank_load_bound (vector loads), not at the slot's rank; where() drops the columns
        # between (and the never-written partials past the rank below), so whatever the padding holds,
        # even NaN, never reaches the sum.
        r_in = rr < bound
        bv = tl.load(
            b_base[:, None] + b_rank_offset(rr, U, stride_bp)[None, :],
            mask=n_ok[:, None] & r_in[None, :],
            other=0.0,
        )
        bv = tl.where(r_ok[None, :], bv.to(tl.float32), 0.0)
        if PDL:  # launched beside the shrink: its partials are complete and visible after this
            tl.extra.cuda.gdc_wait()
        hsel = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        for i in tl.static_range(N_SLICES):
            in_i = (offs_n >= slice_bound(i, o0, o1, o2, o3, o4)) & (
                offs_n < slice_bound(i + 1, o0, o1, o2, o3, o4)
            )
            pv = tl.load(
                p_base + sp[:, None] * stride_ps + i * R + rr[None, :],
                mask=(sp[:, None] < SPLIT_K) & r_in[None, :],
                other=0.0,
            )
            hv = tl.where(r_ok, tl.sum(pv.to(tl.float32), axis=0), 0.0).to(H_DTYPE).to(tl.float32)
            hv = hv * tl.load(scal_ptr + slot * stride_ss + i)
            if PER_SLICE:  # a [BLOCK_N] reduction per slice: fewer live registers than a selected tile
                acc = tl.where(in_i, acc + tl.sum(bv * hv[None, :], axis=1), acc)
            else:
                hsel = tl.where(in_i[:, None], hv[None, :], hsel)
        if not PER_SLICE:
            acc += tl.sum(bv * hsel, axis=1)
    tl.store(o_ptrs, (prev.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=n_ok)


def _tl_dtype(dtype: torch.dtype) -> tl.dtype:
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def _block_r(R: int) -> int:
    """Ranks per tile: RANK_TILE, or the pool's rank (a power of two) when smaller."""
    return min(RANK_TILE, next_pow2(R))


def _split_p2() -> int:
    return next_pow2(TUNING["max_split_k"])


class _ShrinkPlan:
    """Launch shape of one shrink, from host ints only; only ``split_k``, ``k_per_split`` and ``r_tiles``
    follow the batch, and they are run-time arguments."""

    def __init__(
        self,
        T: int,
        in_features: int,
        n: int,
        R: int,
        bound: int,
        device: torch.device,
        split_k: int | None,
    ):
        self.ns_p2 = next_pow2(n)
        self.block_r = _block_r(R)
        rows = self.ns_p2 * self.block_r
        self.block_k = min(256, max(32, TUNING["shrink_tile"] // rows))
        self.even_k = in_features % self.block_k == 0  # splits are whole BLOCK_K tiles: all tiles whole
        self.r_tiles = cdiv(bound, self.block_r)  # the batch's rank bound, not the pool's rank
        self.k_per_split, self.split_k = split_k_plan(
            in_features, self.block_k, T * self.r_tiles, device, split_k, TUNING
        )
        self.launches: dict[tuple, LaunchPlan] = {}  # per argument layout (strides, skip_pad)


def _shrink_partials(job: ShrinkJob, zero: bool = True, pdl: bool = False) -> torch.Tensor:
    """Launch shrink; returns its fp32 split-K partials [SPLIT_K, T, n*R] (zeroed first with ``zero``:
    rank padding is then 0 rather than unwritten), planes padded to 16 rows. ``pdl``: the next launch on
    the stream is its expand, as a programmatic dependent (:func:`pdl_launch`)."""
    x, A, info, n, R, skip_pad, split_k = job
    T, bound = info.num_tokens, job.top_rank
    key = ("bgmv_plan", x.shape[1], n, R, bound, split_k)  # once per forward and module shape
    plan = info.host_derived.get(key)
    if plan is None:
        plan = info.host_derived[key] = _ShrinkPlan(T, x.shape[1], n, R, bound, x.device, split_k)
    alloc = torch.zeros if zero else torch.empty
    # Planes padded to 16 rows: their stride keeps the same divisibility (which Triton compiles for) at
    # every token count.
    shape = (plan.split_k, -(-T // 16) * 16, n * R)
    p = alloc(shape, dtype=torch.float32, device=x.device)
    # The launch itself, planned once per forward and argument layout: the layers share it.
    layout = (x.stride(0), A.stride(), A.shape, skip_pad, pdl)
    launch = plan.launches.get(layout)
    if launch is None:
        *a_strides, U = a_page_args(A, n)
        launch = plan.launches[layout] = fast(_bgmv_shrink_kernel).plan(
            (T * plan.split_k * plan.r_tiles,),
            (
                None, None, None, info.token_slots, info.ranks,
                x.shape[1], R, plan.k_per_split, x.stride(0), *a_strides, shape[1] * shape[2], shape[2], plan.split_k, plan.r_tiles,
            ),
            dict(
                N_SLICES=n, NS_P2=plan.ns_p2, SKIP_PAD=skip_pad, U=U, BLOCK_R=plan.block_r, BLOCK_K=plan.block_k,
                EVEN_K=plan.even_k, PDL=pdl_launch(x.device, pdl), num_warps=TUNING["shrink_warps"],
            ),
            (0, 1, 2),
        )  # fmt: skip
    fast(_bgmv_shrink_kernel).launch_plan(launch, (x, A, p))
    return p[:, :T]


def _expand(
    p: torch.Tensor,
    weights: LoRAWeights,
    info: LoRABatchInfo,
    out: torch.Tensor,
    R: int,
    h_dtype: torch.dtype,
    pdl: bool = False,
) -> None:
    """``pdl``: launched right after the shrink that wrote ``p`` (:func:`_shrink_partials` with ``pdl``),
    as its programmatic dependent; ``out`` must then be complete before that shrink started."""
    B, scalings, slice_offsets = weights.B, weights.scalings, weights.slice_offsets
    # The rank tile follows the batch's rank bucket, not the pool rank: a rank-16 batch of a rank-64
    # pool gets the rank-16 pool's tiles (one compile per bucket; the warm-up covers every bucket).
    bound = rank_bucket_bound(info, R)
    block_r = min(next_pow2(bound), max(_block_r(bound), TUNING["expand_rank_tile"] or 0))
    # The launch, planned once per forward and argument layout (the layers share it).
    key = (
        "bgmv_expand", R, block_r, B.shape, B.stride(), out.stride(0), scalings.stride(0), slice_offsets,
        p.shape[0], p.stride(0), p.stride(1), h_dtype, pdl,
    )  # fmt: skip
    launch = info.host_derived.get(key)
    if launch is None:
        n = weights.n_slices
        n_out = B.shape[-2]
        *b_strides, U = b_page_args(B)
        block_n = min(512, max(32, TUNING["expand_tile"] // block_r))
        n_tiles = cdiv(n_out, block_n)
        launch = info.host_derived[key] = fast(_bgmv_expand_kernel).plan(
            (info.num_tokens * n_tiles,),
            (
                None, None, None, None, info.token_slots, info.ranks,
                R, n_out, p.stride(0), p.stride(1), *b_strides, out.stride(0),
                scalings.stride(0), *offset_args(slice_offsets), n_tiles, p.shape[0],
            ),
            dict(
                SPLIT_P2=max(_split_p2(), next_pow2(p.shape[0])), N_SLICES=n, U=U, BLOCK_N=block_n,
                BLOCK_R=block_r, H_DTYPE=_tl_dtype(h_dtype), PER_SLICE=TUNING["expand_per_slice"],
                num_warps=TUNING["expand_warps"], **pdl_options(pdl_launch(out.device, pdl)),
            ),
            (0, 1, 2, 3),
        )  # fmt: skip
    fast(_bgmv_expand_kernel).launch_plan(launch, (p, B, out, scalings))


def bgmv_shrink(
    x: Tensor, A: Tensor, info: LoRABatchInfo, n_slices: int | None = None, split_k: int | None = None
) -> Tensor:
    """``h[t] = x[t] @ A[token_slots[t]].T`` per token (zeros for base-only rows), in x.dtype.

    ``n_slices`` lets the kernel skip rank padding per slice (see :func:`sgmv_shrink`); ``split_k``
    overrides the split-K heuristic (for tests and benchmarks).
    """
    return shrink_entry(_shrink_partials, x, A, info, n_slices, split_k)


def bgmv_expand(h: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, out: torch.Tensor) -> None:
    """``out[t, slice] += h[t, slice] @ B[token_slots[t], slice].T * scalings[slot, slice]``, one launch."""
    _, R = check_expand_args(h, weights, info, out)
    if not info.has_lora or info.num_tokens == 0:
        return
    _expand(h.unsqueeze(0), weights, info, out, R, h.dtype)


@register_backend("triton-bgmv")
class TritonBGMVBackend(FusedTritonBackend):
    """Per-token Triton kernels; best for decode."""

    def _fused(
        self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, R: int
    ) -> None:
        """Partials unzeroed: shrink skips rank padding per slice and expand masks it out. The expand
        follows its shrink on the stream: a programmatic dependent where TUNING["pdl"] asks."""
        # PDL pairs the expand with the shrink only: not with a reduction between them.
        pdl = TUNING["pdl"] and not TUNING["reduce_partials"]
        self._expand_phase(out, self._shrink_phase(x, weights, info, R, pdl), weights, info, R, x.dtype, pdl)

    def _shrink_phase(
        self, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, R: int, pdl: bool = False
    ) -> torch.Tensor:
        job = ShrinkJob(x, weights.A, info, weights.n_slices, R, True, self.split_k)
        return _shrink_partials(job, zero=False, pdl=pdl)

    def _expand_phase(
        self,
        out: torch.Tensor,
        partials: torch.Tensor,
        weights: LoRAWeights,
        info: LoRABatchInfo,
        R: int,
        dtype: torch.dtype,
        pdl: bool = False,
    ) -> None:
        if TUNING["reduce_partials"]:
            # Columns past a slot's rank hold whatever the unzeroed planes held (even NaN): the expand
            # drops them by rank, as it does when it sums the planes itself.
            partials = partials.sum(0, dtype=torch.float32).to(dtype).unsqueeze(0)
        _expand(partials, weights, info, out, R, dtype, pdl)
