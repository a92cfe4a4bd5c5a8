"""The SGMV Triton kernels: shrink and expand over segments of tokens that share an adapter (their launch
plans, the public functions and the ``triton-sgmv`` backend are in :mod:`mmlora.backends.triton_sgmv`)."""

from __future__ import annotations

import triton
import triton.language as tl

from mmlora.backends.triton_common import a_row_offset, b_rank_offset, rank_load_bound, select_bound

#: Integer arguments that change with the batch: compiled generically (Triton would otherwise build a
#: variant per value class, e.g. 1 or a multiple of 16, inside a serving run).
#: Not among them: K_PER_SPLIT (a multiple of BLOCK_K, always) and the plane stride (planes are padded
#: to 16 rows): their divisibility by 16 is what lets the loads be vectorised. A run on an H200 with
#: them (and BGMV's) unspecialised had 20-38% slower decode steps (2026-12-01; BGMV is unchanged since).
_SHRINK_BATCH_INTS = ("M_TILES", "SPLIT_K")
_EXPAND_BATCH_INTS = ("SPLIT_K", "M_TILES")


@triton.jit
def _tile(
    tile, seg_indptr_ptr, tile_seg_ptr, tile_m0_ptr, M_TILES, BLOCK_M: tl.constexpr, TILED: tl.constexpr
):
    """(segment, first token) of token tile ``tile``: from the tile table, or M_TILES tiles per segment."""
    if TILED:
        seg = tl.load(tile_seg_ptr + tile)
        m0 = tl.load(tile_m0_ptr + tile)
    else:
        seg = tile // M_TILES
        m0 = tl.load(seg_indptr_ptr + seg) + (tile % M_TILES) * BLOCK_M
    return seg, m0


@triton.jit(do_not_specialize=_SHRINK_BATCH_INTS)
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, h_ptr, seg_indptr_ptr, weight_indices_ptr, ranks_ptr, tile_seg_ptr, tile_m0_ptr,
    in_features, R, K_PER_SPLIT, stride_xm, stride_as, stride_ap, stride_ar, stride_hs, stride_hm,
    M_TILES, R_TILES, SPLIT_K,
    N_SLICES: tl.constexpr, NS_P2: tl.constexpr, SKIP_PAD: tl.constexpr, U: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, TILED: tl.constexpr, PDL: tl.constexpr,
    AFTER: tl.constexpr,
):  # fmt: skip
    """Shrink, split over in_features: for segment i with slot w[i] >= 0 and split k:
    ``h[k, s[i]:s[i+1]] = x[s[i]:s[i+1], Kk] @ A[w[i], :, Kk].T`` (sum over k gives the shrink).

    x [T, in] (fp32/fp16/bf16), A [S, N_SLICES * R, in] or paged [S, R / U, N_SLICES * U, in] (x.dtype; unpaged: U = 0),
    h [SPLIT_K, T, N_SLICES * R]
    (x.dtype when SPLIT_K = 1, else fp32 partials). A program covers BLOCK_M tokens x (all slices,
    BLOCK_R ranks) x one split; every element of h in the R_TILES rank tiles is written: rows of
    base-only segments and columns past the adapter's rank as zeros. fp32 accumulation. TILED: token tiles come from the tile table
    (tile i: segment tile_seg[i], first token tile_m0[i]) instead of M_TILES per segment.
    AFTER: launched as a programmatic dependent of the kernel before it (the base GEMM), which it overlaps:
    it reads nothing that kernel writes, and waits for it (``gdc_wait``) before every exit, so its
    completion, which the expand waits for, implies that kernel's.
    """
    if PDL:  # the expand (a programmatic dependent) may start now; it waits before reading h
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    pid_r = pid % R_TILES
    sp = (pid // R_TILES) % SPLIT_K
    seg, m0 = _tile(
        pid // (R_TILES * SPLIT_K), seg_indptr_ptr, tile_seg_ptr, tile_m0_ptr, M_TILES, BLOCK_M, TILED
    )
    seg_end = tl.load(seg_indptr_ptr + seg + 1)
    if m0 >= seg_end:
        if AFTER:
            tl.extra.cuda.gdc_wait()
        return
    slot = tl.load(weight_indices_ptr + seg)
    if SKIP_PAD:
        rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    else:
        rank = R
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < seg_end
    j = tl.arange(0, NS_P2 * BLOCK_R)
    r = pid_r * BLOCK_R + j % BLOCK_R
    col = (j // BLOCK_R) * R + r
    col_ok = (j // BLOCK_R < N_SLICES) & (r < R)
    h_ptrs = h_ptr + sp * stride_hs + offs_m[:, None] * stride_hm + col[None, :]
    h_mask = m_ok[:, None] & col_ok[None, :]
    if (slot < 0) | (pid_r * BLOCK_R >= rank):
        tl.store(h_ptrs, tl.zeros((BLOCK_M, NS_P2 * BLOCK_R), dtype=h_ptr.dtype.element_ty), mask=h_mask)
        if AFTER:
            tl.extra.cuda.gdc_wait()
        return
    w_ok = col_ok & (r < rank)
    a_base = a_ptr + slot.to(tl.int64) * stride_as + a_row_offset(j // BLOCK_R, r, R, U, stride_ap, stride_ar)
    acc = tl.zeros((BLOCK_M, NS_P2 * BLOCK_R), dtype=tl.float32)
    k_lo = sp * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, in_features)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_hi
        xt = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        at = tl.load(a_base[None, :] + kk[:, None], mask=w_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, at, acc, input_precision=PREC)
    tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=h_mask)
    if AFTER:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _h_tile(h_ptr, offs_m, m_ok, cols, cols_ok, SPLIT_K, stride_hs, stride_hm, dtype: tl.constexpr):
    """h [BLOCK_M, len(cols)] summed over shrink's SPLIT_K planes and rounded to ``dtype`` (x.dtype, as PEFT
    keeps h; exact when SPLIT_K == 1, where h is already in x.dtype); 0 outside the masks."""
    ptrs = h_ptr + offs_m[:, None] * stride_hm + cols[None, :]
    mask = m_ok[:, None] & cols_ok[None, :]
    hsum = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    for sp in range(1, SPLIT_K):
        hsum += tl.load(ptrs + sp * stride_hs, mask=mask, other=0.0).to(tl.float32)
    return hsum.to(dtype)


@triton.jit(do_not_specialize=_EXPAND_BATCH_INTS)
def _sgmv_expand_kernel(
    h_ptr, b_ptr, out_ptr, scal_ptr, seg_indptr_ptr, weight_indices_ptr, ranks_ptr, tile_seg_ptr, tile_m0_ptr,
    R, SPLIT_K, stride_hs, stride_hm, stride_bs, stride_bp, stride_bn, stride_om, stride_ss, o0, o1, o2, o3, o4,
    M_TILES, N_TILES, h_pos_ptr, stride_hpos,
    N_SLICES: tl.constexpr, U: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, TILED: tl.constexpr, PDL: tl.constexpr,
    EARLY_OUT: tl.constexpr, N_GROUP: tl.constexpr, GROUP_STAGES: tl.constexpr, H_UNROLL: tl.constexpr,
    B_FIRST: tl.constexpr, TRIGGER: tl.constexpr, H_POS: tl.constexpr,
):  # fmt: skip
    """Expand, all slices in one launch: for segment i with slot w[i] >= 0 and slice j:
    ``y[s[i]:s[i+1], o[j]:o[j+1]] += h[s[i]:s[i+1], j*R:j*R+r] @ B[w[i], o[j]:o[j+1], :r].T * sc[w[i], j]``.

    h [SPLIT_K, T, N_SLICES * R]: shrink's split-K planes, summed here and rounded to B's dtype (x.dtype,
    as PEFT keeps h), B [S, out, R] or paged [S, R / U, out, U] (unpaged: U = 0),
    scalings [S, N_SLICES] fp32, out [T, out] (any float dtype, updated
    in place), r = ranks[w[i]]. A program covers BLOCK_M tokens x BLOCK_N columns of one slice and
    loops over the rank only up to r; fp32 accumulation. TILED: token tiles from the tile table, as in
    shrink. PDL: launched as a programmatic dependent of the shrink, it loads its B tile first and waits
    for the shrink only before it reads h. EARLY_OUT: the out tile and the scaling are loaded before the
    rank loop, in flight with the B tile, rather than after it. N_GROUP > 1 (BLOCK_K covering every rank
    of the batch, so there is no rank loop): a program covers N_GROUP consecutive column tiles of its
    slice, N_TILES counting such groups; it loads h and the scaling once, then streams B and out tile by
    tile (a loop GROUP_STAGES deep), so a small expand is no longer one chain of dependent loads per tile.
    TRIGGER: the next kernel, if launched as a programmatic dependent, may launch now (it waits for this one
    to finish before it reads anything). H_POS: h is one plane whose rows hold every staged adapter's
    shrink side by side (the staged shrink, :mod:`mmlora.lora.stage`): slot w[i]'s columns start at
    ``h_pos[w[i]] * stride_hpos`` (h_pos [S] int32, the slot's stage position; in a paged pool a position
    is a page, and the slot's pages follow it, each with its N_SLICES * U columns, see ``_h_cols``).
    """
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    pid_n = pid % (N_SLICES * N_TILES)
    seg, m0 = _tile(
        pid // (N_SLICES * N_TILES), seg_indptr_ptr, tile_seg_ptr, tile_m0_ptr, M_TILES, BLOCK_M, TILED
    )
    s = pid_n // N_TILES
    lo = select_bound(s, o0, o1, o2, o3, o4)
    hi = select_bound(s + 1, o0, o1, o2, o3, o4)
    n0 = lo + (pid_n % N_TILES) * (N_GROUP * BLOCK_N)
    seg_end = tl.load(seg_indptr_ptr + seg + 1)
    slot = tl.load(weight_indices_ptr + seg)
    if (n0 >= hi) | (m0 >= seg_end) | (slot < 0):
        return
    if H_POS:
        h_ptr += tl.load(h_pos_ptr + slot).to(tl.int64) * stride_hpos
    if N_GROUP > 1:
        _expand_group(
            h_ptr, b_ptr, out_ptr, scal_ptr, ranks_ptr, slot, s, m0, seg_end, n0, hi, R, SPLIT_K,
            stride_hs, stride_hm, stride_bs, stride_bp, stride_bn, stride_om, stride_ss,
            N_GROUP, N_SLICES, U, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PREC, PDL, GROUP_STAGES, H_UNROLL, B_FIRST,
            H_POS,
        )  # fmt: skip
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_ok = offs_m < seg_end
    n_ok = offs_n < hi
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    o_mask = m_ok[:, None] & n_ok[None, :]
    if EARLY_OUT:  # out was written before the shrink started, so even a PDL launch may read it now
        prev = tl.load(o_ptrs, mask=o_mask)
        scale = tl.load(scal_ptr + slot * stride_ss + s)
    rank = tl.load(ranks_ptr + slot)
    bound = rank_load_bound(rank, R)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + offs_n * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < bound  # vector loads; h is 0 past the rank, B's padding is dropped below
        bt = tl.load(
            b_base[None, :] + b_rank_offset(kk, U, stride_bp)[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        bt = tl.where((kk < rank)[:, None], bt, 0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        hdt = b_ptr.dtype.element_ty
        cols, h_ok = _h_cols(s, kk, k_ok, rank, R, U, N_SLICES, H_POS)
        ht = _h_sum(h_ptr, offs_m, m_ok, cols, h_ok, SPLIT_K, stride_hs, stride_hm, hdt, H_UNROLL)
        if UPCAST:
            ht = ht.to(tl.float32)
            bt = bt.to(tl.float32)
        acc = tl.dot(ht, bt, acc, input_precision=PREC)
    if not EARLY_OUT:
        # The out tile is loaded last by default: loading it before the loop (to overlap latencies)
        # measured slower on an H200 (register pressure, 32-token tiles), 2026-11-30.
        scale = tl.load(scal_ptr + slot * stride_ss + s)
        prev = tl.load(o_ptrs, mask=o_mask)
    tl.store(o_ptrs, (prev.to(tl.float32) + acc * scale).to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _expand_group(
    h_ptr, b_ptr, out_ptr, scal_ptr, ranks_ptr, slot, s, m0, seg_end, n0, hi, R, SPLIT_K,
    stride_hs, stride_hm, stride_bs, stride_bp, stride_bn, stride_om, stride_ss,
    N_GROUP: tl.constexpr, N_SLICES: tl.constexpr, U: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
    GROUP_STAGES: tl.constexpr, H_UNROLL: tl.constexpr, B_FIRST: tl.constexpr, H_POS: tl.constexpr,
):  # fmt: skip
    """The expand's N_GROUP column tiles from ``n0`` (within ``[.., hi)``) for one token tile of one slot
    and slice, its whole rank in one BLOCK_K step (see ``_sgmv_expand_kernel``). B_FIRST (0 or 1): the
    first tile's B is loaded before the wait for the shrink (which does not write B) and its out tile
    right after it, before h: both in flight with h's loads instead of after them."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < seg_end
    rank = tl.load(ranks_ptr + slot)
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < rank_load_bound(rank, R)
    scale = tl.load(scal_ptr + slot * stride_ss + s)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + b_rank_offset(kk, U, stride_bp)
    if B_FIRST:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        b_first = _group_b(b_rows, offs_n, n_ok, kk, k_ok, rank, stride_bn, UPCAST)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if B_FIRST:
        # Out is read only after the wait: with a shrink that is itself a dependent launch of the base
        # GEMM (``AFTER``), that GEMM may still be writing it before then.
        o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        o_mask = m_ok[:, None] & n_ok[None, :]
        prev_first = tl.load(o_ptrs, mask=o_mask)
    cols, h_ok = _h_cols(s, kk, k_ok, rank, R, U, N_SLICES, H_POS)
    ht = _h_sum(
        h_ptr, offs_m, m_ok, cols, h_ok, SPLIT_K, stride_hs, stride_hm, b_ptr.dtype.element_ty, H_UNROLL
    )
    if UPCAST:
        ht = ht.to(tl.float32)
    if B_FIRST:
        _group_store(ht, b_first, prev_first, o_ptrs, o_mask, scale, out_ptr.dtype.element_ty, PREC)
    for t in tl.range(B_FIRST, N_GROUP, num_stages=GROUP_STAGES):
        offs_n = n0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        bt = _group_b(b_rows, offs_n, n_ok, kk, k_ok, rank, stride_bn, UPCAST)
        o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        o_mask = m_ok[:, None] & n_ok[None, :]
        prev = tl.load(o_ptrs, mask=o_mask)
        _group_store(ht, bt, prev, o_ptrs, o_mask, scale, out_ptr.dtype.element_ty, PREC)


@triton.jit
def _group_b(b_rows, offs_n, n_ok, kk, k_ok, rank, stride_bn, UPCAST: tl.constexpr):
    """B's tile [BLOCK_K, len(offs_n)] of a grouped expand, 0 past the slot's rank."""
    bt = tl.load(b_rows[:, None] + offs_n[None, :] * stride_bn, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
    bt = tl.where((kk < rank)[:, None], bt, 0.0)  # B's padding past the rank may hold anything
    if UPCAST:
        bt = bt.to(tl.float32)
    return bt


@triton.jit
def _group_store(ht, bt, prev, o_ptrs, o_mask, scale, dtype: tl.constexpr, PREC: tl.constexpr):
    """``out = prev + (h @ B) * scale`` for one tile of a grouped expand (fp32 sums, rounded once)."""
    acc = tl.dot(ht, bt, input_precision=PREC)
    tl.store(o_ptrs, (prev.to(tl.float32) + acc * scale).to(dtype), mask=o_mask)


@triton.jit
def _h_planes(h_ptr, offs_m, m_ok, cols, cols_ok, SPLIT_K, stride_hs, stride_hm, dtype: tl.constexpr,
              MAX_SPLIT: tl.constexpr):  # fmt: skip
    """h [BLOCK_M, len(cols)] summed over the shrink's SPLIT_K planes and rounded to ``dtype``, as
    ``_h_tile`` (which takes more than MAX_SPLIT planes); up to MAX_SPLIT the loads are unrolled (predicated
    per plane), so they are all in flight together instead of one after another."""
    if SPLIT_K > MAX_SPLIT:
        h = _h_tile(h_ptr, offs_m, m_ok, cols, cols_ok, SPLIT_K, stride_hs, stride_hm, dtype)
    else:
        ptrs = h_ptr + offs_m[:, None] * stride_hm + cols[None, :]
        hsum = tl.load(ptrs, mask=m_ok[:, None] & cols_ok[None, :], other=0.0).to(tl.float32)
        for sp in tl.static_range(1, MAX_SPLIT):
            in_plane = m_ok & (offs_m * 0 + sp < SPLIT_K)  # a tensor mask (the interpreter's & needs one)
            plane = tl.load(ptrs + sp * stride_hs, mask=in_plane[:, None] & cols_ok[None, :], other=0.0)
            hsum += plane.to(tl.float32)
        h = hsum.to(dtype)
    return h


@triton.jit
def _h_cols(s, kk, k_ok, rank, R, U: tl.constexpr, N_SLICES: tl.constexpr, H_POS: tl.constexpr):
    """(h's columns for ranks ``kk`` of slice ``s``, which of them to read): ``s * R + kk`` as the shrink
    writes them, read where ``k_ok``; or, in a staged shrink of a paged pool (the GEMM's columns follow A's
    rows: page, slice, rank within the page), ``(kk // U) * N_SLICES * U + s * U + kk % U``, read only in
    the slot's own pages: ``k_ok`` may reach past them (a rank bound of 16 over pages of fewer ranks), into
    the next positions, past h's end at the last one (NaN there would survive B's zeroed padding)."""
    if H_POS and U > 0:
        return (kk // U) * (N_SLICES * U) + s * U + kk % U, k_ok & (kk < tl.cdiv(rank, U) * U)
    return s * R + kk, k_ok


@triton.jit
def _h_sum(h_ptr, offs_m, m_ok, cols, cols_ok, SPLIT_K, stride_hs, stride_hm, dtype: tl.constexpr,
           UNROLL: tl.constexpr):  # fmt: skip
    """h summed over its planes as ``_h_planes`` with UNROLL (> 0) unrolled loads, else as ``_h_tile``."""
    if UNROLL > 0:
        h = _h_planes(h_ptr, offs_m, m_ok, cols, cols_ok, SPLIT_K, stride_hs, stride_hm, dtype, UNROLL)
    else:
        h = _h_tile(h_ptr, offs_m, m_ok, cols, cols_ok, SPLIT_K, stride_hs, stride_hm, dtype)
    return h
