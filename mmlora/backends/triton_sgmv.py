"""triton-sgmv: segmented gather matmul (Punica's SGMV) for runs of tokens that share an adapter.

One program computes a tile of ``BLOCK_M`` tokens of one segment against that segment's adapter with
``tl.dot``; the grid is (segments x token tiles x output tiles) flattened on axis 0, sized from host
ints of the batch info (``num_segments``, the longest segment, the rank bucket), so launches need no
device sync. Programs past the end of their segment, of a base-only segment (slot -1) or of their
adapter's rank return early: mixed ranks share one launch without computing the padding.

CUDA graphs: the grid depends on ``num_segments`` and the longest segment, so a decode graph is
captured in the ``runs`` layout (``LoRABatchInfo.fill_rows``): a fixed number of segment entries
(``LoRABackend.graph_segments``: one per row here), each at most ``RUN_TILE`` rows long, the unused ones
empty. A replay then reads each adapter once per run of
adjacent rows on it (the graph runner sorts rows by slot), and the empty segments' programs return at
once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmlora.backends.registry import register_backend
from mmlora.backends.triton_checks import check_expand_args
from mmlora.backends.triton_common import (
    FusedTritonBackend,
    ShrinkJob,
    a_page_args,
    b_page_args,
    cdiv,
    dot_upcast,
    next_pow2,
    offset_args,
    pdl_launch,
    pdl_options,
    rank_bucket_bound,
    shrink_entry,
    split_k_plan,
)
from mmlora.backends.triton_sgmv_act import TUNING as ACT_TUNING
from mmlora.backends.triton_sgmv_act import SGMVDeferred
from mmlora.backends.triton_sgmv_kernels import _sgmv_expand_kernel, _sgmv_shrink_kernel
from mmlora.backends.triton_sgmv_tuning import TUNING
from mmlora.forward.host_copy import to_device
from mmlora.forward.lora import RANK_TILE, LoRABatchInfo, LoRAWeights
from mmlora.triton_launch import fast


def _block_m(max_seg_len: int, cap: int) -> int:
    return min(cap, max(16, next_pow2(max_seg_len)))


class _Tiles:
    """Token tiles of one forward for a BLOCK_M: a segment longer than BLOCK_M next to short ones (a
    prefill chunk among decode rows) would otherwise give every segment the longest one's tile count,
    nearly all of them empty programs. The table (tile i: segment ``seg[i]``, first token ``m0[i]``) is
    built from host ints once per forward and shared by every layer; batches whose segments all fit one
    tile (decode, CUDA graphs) need none."""

    def __init__(self, info: LoRABatchInfo, block_m: int) -> None:
        max_seg = info.max_seg_len
        self.block_m = block_m
        self.tiled = max_seg > block_m
        self.m_tiles = 1  # untiled, every segment fits one tile
        self.count = info.num_segments
        if block_m in info.graph_tiles:  # a mixed-step graph: its fixed-size table, filled per step
            self.tiled = True
            self.seg, self.m0, self.count = info.graph_tiles[block_m]
            return
        seg_ids, starts, start = [], [], 0
        if self.tiled:
            for i, n in enumerate(info.seg_lens_host):
                for m in range(start, start + n, block_m):
                    seg_ids.append(i)
                    starts.append(m)
                start += n
            # Rows padded to 16 entries: the second row's pointer stays 64-byte aligned, so its alignment
            # (which Triton compiles for) does not change with the tile count.
            pad = [0] * (-len(seg_ids) % 16)
            table = to_device([seg_ids + pad, starts + pad], torch.int32, info.seg_indptr.device)
            self.seg, self.m0 = table[0], table[1]
            self.count = len(seg_ids)
        else:
            self.seg = self.m0 = info.seg_indptr  # unread (TILED off); any int32 device tensor

    @staticmethod
    def of(info: LoRABatchInfo, block_m: int) -> _Tiles:
        key = ("sgmv_tiles", block_m)
        if key not in info.host_derived:
            info.host_derived[key] = _Tiles(info, block_m)
        return info.host_derived[key]


def _shrink_launch(
    job: ShrinkJob, fp32_planes: bool, pdl: bool = False, whole_rank: bool = True, after: bool = False
) -> tuple[tuple[int], tuple, dict, tuple[int, int, int], torch.dtype]:
    """(grid, positional args with None for h, keyword args, h's padded shape, h's dtype) of shrink's
    launch. The rank tile follows the batch's rank bucket (``job.top_rank``), not the pool rank, so a
    rank-16 batch of a rank-64 pool runs the rank-16 pool's tiles: one compile per bucket, all made by
    the warm-up; programs still stop at their slot's rank. ``whole_rank``: every column of h up to the
    pool rank is written (zeros past each rank); otherwise only those below the bucket, all that the
    fused expand reads (it stops at :func:`rank_load_bound`, at most the bucket). ``after``: launched as a
    programmatic dependent of the kernel before it (``AFTER`` in the kernel), which must not write x."""
    x, A, info, n, R, skip_pad, split_k = job
    T, in_f, top_rank = info.num_tokens, x.shape[1], job.top_rank
    ns_p2 = next_pow2(n)
    block_r = min(max(16, next_pow2(top_rank)), max(16, 128 // ns_p2))
    tiles = _Tiles.of(info, _block_m(info.max_seg_len, TUNING["shrink_block_m"]))
    runs = tiles.block_m <= 16
    block_k = (TUNING["run_shrink_block_k"] if runs else None) or (64 if tiles.block_m >= 64 else 128)
    if split_k:  # a forced split (tests, benchmarks) gets blocks small enough to honour it
        block_k = min(block_k, max(16, next_pow2(cdiv(in_f, split_k))))
    r_tiles = cdiv(R if whole_rank else top_rank, block_r)
    # Split in_features until the launch has a few waves of programs: a long segment alone would
    # otherwise leave most of the GPU idle (the rank dimension gives almost no parallelism).
    busy = tiles.count * cdiv(top_rank, block_r)
    waves = TUNING["run_waves"] if runs else None
    tuning = TUNING if waves is None else {**TUNING, "waves": waves}
    # Decode runs may also cap in_features per split (``run_shrink_k_per_split``): a wide module (down's
    # 14,336) otherwise gives each program several times the serial loop of the others.
    k_cap = TUNING["run_shrink_k_per_split"] if runs else None
    least = cdiv(in_f, k_cap) if k_cap else 1
    k_per_split, split = split_k_plan(in_f, block_k, busy, x.device, split_k, tuning, least)
    dtype = x.dtype if split == 1 and not fp32_planes else torch.float32
    # Planes padded to 16 rows: their stride keeps the same divisibility for every batch.
    shape = (split, -(-T // 16) * 16, n * R)
    *a_strides, U = a_page_args(A, n)
    args = (
        x, A, None, info.seg_indptr, info.weight_indices, info.ranks, tiles.seg, tiles.m0,
        in_f, R, k_per_split, x.stride(0), *a_strides, shape[1] * shape[2], shape[2], tiles.m_tiles, r_tiles,
        split,
    )  # fmt: skip
    kwargs = dict(
        N_SLICES=n, NS_P2=ns_p2, SKIP_PAD=skip_pad, U=U, BLOCK_M=tiles.block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        UPCAST=dot_upcast(x.dtype), PREC="ieee" if x.dtype == torch.float32 else "tf32", TILED=tiles.tiled,
        PDL=pdl, AFTER=after, num_warps=TUNING["shrink_warps"],
    )  # fmt: skip
    if after:
        kwargs["launch_pdl"] = True
    stages = TUNING["run_shrink_stages"] if runs else None
    if stages is not None:
        kwargs["num_stages"] = stages
    return (tiles.count * split * r_tiles,), args, kwargs, shape, dtype


def _shrink_planes(job: ShrinkJob, fp32_planes: bool = False) -> torch.Tensor:
    """Launch shrink; returns h as [SPLIT_K, T, n*R] planes (fp32 partials, or x.dtype when there is one
    plane and not ``fp32_planes``)."""
    grid, args, kwargs, shape, dtype = _shrink_launch(job, fp32_planes)
    h = torch.empty(shape, dtype=dtype, device=job.x.device)[:, : job.info.num_tokens]
    fast(_sgmv_shrink_kernel)[grid](*args[:2], h, *args[3:], **kwargs)
    return h


def _rank_step(info: LoRABatchInfo, R: int, runs: bool) -> int:
    """Ranks per step of an expand's rank loop: at least 16 (the smallest tl.dot K), at most the batch's
    rank bucket (``run_expand_rank_step`` for 16-token tiles, i.e. decode runs)."""
    step = TUNING["run_expand_rank_step"] if runs else TUNING["expand_rank_step"]
    return min(step, max(RANK_TILE, next_pow2(rank_bucket_bound(info, R))))


def _expand_launch(
    h_strides: tuple[int, int, int],
    weights: LoRAWeights,
    info: LoRABatchInfo,
    out_stride: int,
    R: int,
    pdl: bool = False,
    h_pos: torch.Tensor | None = None,
) -> tuple[tuple[int], tuple, dict]:
    """(grid, positional args with None for h and out, keyword args) of expand's launch over h's planes
    given as (planes, plane stride, row stride), into an out of row stride ``out_stride``. ``pdl``: launched right after the shrink that writes h (with
    ``pdl``), as its programmatic dependent (:func:`pdl_launch`). ``h_pos``: h is a staged shrink, each
    slot's n * R columns at its stage position (a paged pool's positions are pages of n * U columns;
    ``H_POS`` in the kernel)."""
    B, scalings, slice_offsets = weights.B, weights.scalings, weights.slice_offsets
    n = weights.n_slices
    widths = [b - a for a, b in zip(slice_offsets, slice_offsets[1:])]
    tiles = _Tiles.of(info, _block_m(info.max_seg_len, TUNING["block_m"]))
    block_n = TUNING["block_n"]
    runs = tiles.block_m <= 16
    # The rank in steps of at least 16 (the smallest tl.dot K), at most the batch's rank bucket: a
    # segment stops at its slot's rank, and loads past it are masked, so a rank-8 slot of a rank-64 pool
    # reads its own bytes only.
    block_k = _rank_step(info, R, runs)
    # Grouped only where the whole rank is one step (so h is loaded once for the group).
    group = (TUNING["run_expand_group"] or 1) if runs and block_k >= rank_bucket_bound(info, R) else 1
    least = TUNING["run_expand_group_programs"]
    if group > 1 and least:  # the largest group, up to 4, whose launch keeps ``least`` programs
        column_tiles = cdiv(max(widths), block_n)
        group = next((g for g in (4, 2) if tiles.count * n * cdiv(column_tiles, g) >= least), 1)
    n_tiles = cdiv(cdiv(max(widths), block_n), group)
    warps = TUNING["run_expand_warps"] if runs else TUNING["expand_warps"]
    *b_strides, U = b_page_args(B)
    args = (
        None, B, None, scalings, info.seg_indptr, info.weight_indices, info.ranks, tiles.seg, tiles.m0,
        R, *h_strides, *b_strides, out_stride,
        scalings.stride(0), *offset_args(slice_offsets), tiles.m_tiles, n_tiles,
        info.ranks if h_pos is None else h_pos, 0 if h_pos is None else n * (U or R),  # a position: a page
    )  # fmt: skip
    kwargs = dict(
        N_SLICES=n, U=U, BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=dot_upcast(B.dtype),
        PREC="ieee" if B.dtype == torch.float32 else "tf32", TILED=tiles.tiled,
        EARLY_OUT=runs and TUNING["run_expand_early_out"], N_GROUP=group,
        GROUP_STAGES=TUNING["run_expand_group_stages"] if group > 1 else 1,
        H_UNROLL=(TUNING["run_expand_h_unroll"] or 0) if runs else 0,
        B_FIRST=int(group > 1 and TUNING["run_expand_group_b_first"]),
        TRIGGER=pdl_launch(B.device, TUNING["expand_dependents"]), H_POS=h_pos is not None,
        num_warps=warps, **pdl_options(pdl),
    )  # fmt: skip
    return (tiles.count * n * n_tiles,), args, kwargs


def _expand_planes(
    h: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, out: torch.Tensor, R: int
) -> None:
    """Launch expand over h's planes [SPLIT_K, >= T, n*R] (rows padded or not: its strides are read)."""
    grid, args, kwargs = _expand_launch(
        (h.shape[0], h.stride(0), h.stride(1)), weights, info, out.stride(0), R
    )
    fast(_sgmv_expand_kernel)[grid](h, args[1], out, *args[3:], **kwargs)


class _ModulePlan:
    """Shrink's and expand's launch plans for one module shape in one forward (``_fused``): the layers of
    a model share module shapes and the forward's batch, so every layer after the first launches these
    with its own x, A, B, scalings and out, skipping the launch arithmetic."""

    __slots__ = ("shrink", "expand", "h_shape", "h_dtype")

    def __init__(
        self, job: ShrinkJob, weights: LoRAWeights, out_stride: int, pdl: bool, after: bool = False
    ) -> None:
        # ``pdl``: the expand a programmatic dependent of its shrink; ``after``: the shrink one of the kernel
        # before it. An expand reading out before its wait (EARLY_OUT) could then read it unwritten.
        pdl = pdl_launch(job.x.device, pdl)
        after = pdl and after and not TUNING["run_expand_early_out"]
        grid, args, kwargs, self.h_shape, self.h_dtype = _shrink_launch(
            job, fp32_planes=True, pdl=pdl, whole_rank=False, after=after
        )
        self.shrink = fast(_sgmv_shrink_kernel).plan(grid, args, kwargs, (0, 1, 2))
        splits, rows, cols = self.h_shape
        grid, args, kwargs = _expand_launch(
            (splits, rows * cols, cols), weights, job.info, out_stride, job.R, pdl
        )
        self.expand = fast(_sgmv_expand_kernel).plan(grid, args, kwargs, (0, 1, 2, 3))

    @staticmethod
    def of(
        x: torch.Tensor,
        weights: LoRAWeights,
        info: LoRABatchInfo,
        R: int,
        out_stride: int,
        split_k: int | None,
        pdl: bool,
        after: bool = False,
    ) -> _ModulePlan:
        """The plan for this module shape and an out of row stride ``out_stride`` in this forward (made
        once, shared by the layers); ``after``: see ``_shrink_launch``."""
        A, B, scalings = weights.A, weights.B, weights.scalings
        # Everything the launch arithmetic reads of this call, but the batch (the plan is per forward).
        key = (
            "sgmv_module", x.shape[1], x.stride(0), x.dtype, A.shape, A.stride(), B.shape, B.stride(),
            scalings.stride(0), weights.slice_offsets, out_stride, R, split_k, pdl, after,
        )  # fmt: skip
        plan = info.host_derived.get(key)
        if plan is None:
            job = ShrinkJob(x, A, info, weights.n_slices, R, True, split_k)
            plan = info.host_derived[key] = _ModulePlan(job, weights, out_stride, pdl, after)
        return plan


def sgmv_shrink(
    x: Tensor, A: Tensor, info: LoRABatchInfo, n_slices: int | None = None, split_k: int | None = None
) -> Tensor:
    """``h [T, n*R] = per-segment x @ A[slot].T`` (zeros for base-only rows), in x.dtype.

    ``n_slices`` (the number of slices packed in A) lets the kernel skip rank padding per slice; when
    None, A's rows are one slice of width n*R and every row is computed (same result, more work).
    ``split_k`` overrides the split-K heuristic (tests, benchmarks).
    """
    return shrink_entry(_shrink_planes, x, A, info, n_slices, split_k)


def sgmv_expand(h: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, out: torch.Tensor) -> None:
    """``out[seg, slice] += h[seg, slice] @ B[slot, slice].T * scalings[slot, slice]`` in one launch."""
    _, R = check_expand_args(h, weights, info, out)
    if not info.has_lora or info.num_tokens == 0:
        return
    _expand_planes(h.unsqueeze(0), weights, info, out, R)


@register_backend("triton-sgmv")
class TritonSGMVBackend(FusedTritonBackend):
    """Segment-tiled Triton kernels; best for prefill and chunked prefill (long runs on one adapter)."""

    graph_layouts = ("runs",)
    mixed_graphs = True  # token tiles from fill_graph's fixed tables

    def _fused(
        self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, R: int
    ) -> None:
        """Shrink knows the slice count, so it skips rank padding per slice; its planes are always fp32
        (expand rounds h to x.dtype), so the kernels' signatures do not depend on the batch."""
        self._launch(out, x, weights, info, R, after=False)

    def _fused_after_base(
        self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, R: int
    ) -> None:
        self._launch(out, x, weights, info, R, after=TUNING["shrink_pdl"])

    def launches_after_base(self) -> bool:
        return TUNING["shrink_pdl"]

    def _launch(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        weights: LoRAWeights,
        info: LoRABatchInfo,
        R: int,
        after: bool,
    ) -> None:
        plan = _ModulePlan.of(x, weights, info, R, out.stride(0), self.split_k, TUNING["pdl"], after)
        h = torch.empty(plan.h_shape, dtype=plan.h_dtype, device=x.device)
        fast(_sgmv_shrink_kernel).launch_plan(plan.shrink, (x, weights.A, h))
        fast(_sgmv_expand_kernel).launch_plan(plan.expand, (h, weights.B, out, weights.scalings))

    def add_lora_staged(
        self, out: Tensor, h: Tensor, weights: LoRAWeights, info: LoRABatchInfo, h_pos: Tensor
    ) -> None:
        from mmlora.backends.triton_sgmv_staged import staged_expand  # which builds on this module

        staged_expand(out, h, weights, info, h_pos)

    def defer_lora(self, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> SGMVDeferred | None:
        """The shrink now; the expand deferred to gate_up's gated activation (``TUNING["act_expand"]``),
        which fuses it (:mod:`mmlora.backends.triton_sgmv_act`), or runs it plainly."""
        if not TUNING["act_expand"] or not info.has_lora or info.num_tokens == 0:
            return None
        tiles = _Tiles.of(info, _block_m(info.max_seg_len, ACT_TUNING["block_m"]))
        if tiles.block_m <= 16 and not ACT_TUNING["runs"]:  # decode runs: measured slower fused
            return None
        R = self._input_rank(x, weights, info)
        partials = self._shrink_phase(x, weights, info, R)

        def check(out: torch.Tensor) -> None:
            self._validated_rank(out, x, weights, info)

        def expand(out: torch.Tensor) -> None:
            check(out)
            self._expand_phase(out, partials, weights, info, R, x.dtype)

        block_k = _rank_step(info, R, tiles.block_m <= 16)
        return SGMVDeferred(partials[0], weights, info, R, tiles, block_k, expand, check)

    def warm_up_variants(
        self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo
    ) -> int:
        """Decode runs: the expand in each column-tile group (4, 2, 1) that ``run_expand_group_programs`` may
        pick for a batch of more segments than this one, launched as serving launches it. ``TUNING`` is
        changed for the calls and restored."""
        least, fixed = TUNING["run_expand_group_programs"], TUNING["run_expand_group"]
        if not least or not fixed or fixed < 2 or not info.has_lora or info.max_seg_len > 16:
            return 0
        try:
            TUNING["run_expand_group"] = 2  # what the rule leaves in place when it is off (None below)
            for programs in (1, None, 2**62):  # groups of 4, then 2, then 1
                TUNING["run_expand_group_programs"] = programs
                info.host_derived.clear()  # launch plans are made once per forward
                self.add_lora(out, x, weights, info)
        finally:
            TUNING["run_expand_group_programs"], TUNING["run_expand_group"] = least, fixed
            info.host_derived.clear()
        return 3

    def splits_work(self, info: LoRABatchInfo) -> bool:
        """Prefill-sized batches only, where ``TUNING["side_min_tokens"]`` asks (off by default: measured
        no faster): their base GEMMs are compute-bound, so the memory-bound shrink could share the GPU
        with them; beside the memory-bound GEMMs of decode steps, segment kernels slow the step down."""
        least = TUNING["side_min_tokens"]
        return least is not None and info.num_tokens >= least

    def _shrink_phase(
        self, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, R: int
    ) -> tuple[torch.Tensor, _ModulePlan]:
        """start_lora's first phase: the shrink alone (plain launches: the expand will follow the base
        GEMM, not this shrink). The plan assumes a contiguous ``out`` [T, out_features], as the base
        layer returns; :meth:`_expand_phase` plans again for any other."""
        plan = _ModulePlan.of(x, weights, info, R, weights.B.shape[-2], self.split_k, False)
        h = torch.empty(plan.h_shape, dtype=plan.h_dtype, device=x.device)
        fast(_sgmv_shrink_kernel).launch_plan(plan.shrink, (x, weights.A, h))
        return h, plan

    def _expand_phase(
        self,
        out: torch.Tensor,
        partials: tuple[torch.Tensor, _ModulePlan],
        weights: LoRAWeights,
        info: LoRABatchInfo,
        R: int,
        dtype: torch.dtype,
    ) -> None:
        h, plan = partials
        if out.stride(0) != weights.B.shape[-2]:
            _expand_planes(h, weights, info, out, R)
            return
        fast(_sgmv_expand_kernel).launch_plan(plan.expand, (h, weights.B, out, weights.scalings))
