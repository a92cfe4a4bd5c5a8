"""Triton paged decode attention: one query token per request, split along the context (flash-decoding).

Stage 1 (``_decode_split_kernel``), grid (num_seqs, num_kv_heads, num_splits): one program reads one
KV head of one request over one contiguous slice of the attended range and computes the partial
attention of all query heads sharing that KV head at once (GQA: the KV tile is read once for the
whole group, padded to 16 rows so ``tl.dot`` can be used). It writes the normalised partial output
and its log-sum-exp (base 2). Stage 2 (``_decode_reduce_kernel``), grid (num_seqs, num_q_heads),
merges the splits. With one split (serving's decode graphs from 72 rows) stage 1 writes the output
itself and stage 2 is not launched: the same bits, a launch and a float32 round trip fewer.

The attended range of a request is ``[lo, seq_len)`` with ``lo = max(0, seq_len - window)`` under a
sliding window, so pages wholly outside the window are never read. The range is cut into
``num_splits`` equal, BLOCK_N-aligned slices computed on the device from ``seq_lens``: the grid depends
on host ints only, which keeps the launch capturable in a CUDA graph.

Launch settings (keys per loop step, warps, pipeline depth) come from
:data:`mmlora.layers.attention.decode_tuning.TUNING`, read at every launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmlora.backends.triton_common import next_pow2
from mmlora.layers.attention.decode_tuning import block_n_for, settings
from mmlora.layers.attention.triton_common import attend_key_tile, dot_precision, dot_upcast, softmax_args
from mmlora.triton_launch import fast


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr, o_ptr,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_bt,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h, stride_ot, stride_oh,
    mult, cap_mult, window,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    for s0 in range(start, end, BLOCK_N):  # [start, end) lies in the window: no causal mask (pos 0 unused)
        acc, m_i, l_i = attend_key_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, s0, end, 0, window, kvh,
            stride_cs, stride_ch, offs_n, offs_d, d_mask, mult, cap_mult,
            PAGE, USE_SOFTCAP, False, USE_WINDOW, DOT_PREC, UPCAST,
        )  # fmt: skip

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:  # the whole range in one program: its output is final (no reduce launch)
        o = o_ptr + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o, out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        mo = (
            mid_o_ptr + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + offs_d[None, :]
        )
        tl.store(mo, out, mask=g_mask[:, None] & d_mask[None, :])
        tl.store(mid_lse_ptr + b * stride_ml_b + heads * stride_ml_h + split, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, o_ptr,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + b * stride_ml_b + h * stride_ml_h + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits (lse = -inf) weigh 0
    parts = tl.load(
        mid_o_ptr + b * stride_mo_b + h * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(o_ptr + b * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_mask)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    num_seqs: int,
    num_splits: int,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> None:
    """out[b, h] = softmax-attention of q[b, h] over request b's cached keys, for b < num_seqs.

    q, out [>= num_seqs, Hq, D] (last dim contiguous); k_cache/v_cache [N, page, Hkv, D] contiguous;
    block_tables [>= num_seqs, M] int32; seq_lens [>= num_seqs] int32 (0 gives a zero row). No host
    sync; scratch shapes come from host ints only.
    """
    _, page, hkv, d = k_cache.shape
    hq = q.shape[1]
    group = hq // hkv
    block_d = next_pow2(d)
    tuning = settings()
    block_n = block_n_for(block_d, tuning.block_n)
    if num_splits == 1:  # the kernel writes ``out`` itself and never touches the scratch: no allocation
        mid_o = mid_lse = out
    else:
        mid_o = torch.empty((num_seqs, hq, num_splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((num_seqs, hq, num_splits), dtype=torch.float32, device=q.device)
    kc = k_cache.view(-1, hkv, d)
    mult, cap_mult = softmax_args(scale, logit_softcap)
    fast(_decode_split_kernel)[(num_seqs, hkv, num_splits)](
        q, kc, v_cache.view(-1, hkv, d), block_tables, seq_lens, mid_o, mid_lse, out,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        mult, cap_mult, sliding_window or 0,
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=d, BLOCK_D=block_d,
        PAGE=page, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        USE_SOFTCAP=bool(logit_softcap), USE_WINDOW=bool(sliding_window),
        DOT_PREC=dot_precision(q.dtype), UPCAST=dot_upcast(q.dtype),
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )  # fmt: skip
    if num_splits == 1:
        return
    fast(_decode_reduce_kernel)[(num_seqs, hq)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, BLOCK_S=max(2, next_pow2(num_splits)), HEAD_DIM=d,
        BLOCK_D=block_d, num_warps=tuning.reduce_warps,
    )  # fmt: skip
