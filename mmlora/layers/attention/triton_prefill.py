"""Triton paged prefill attention for varlen batches, on top of a cached prefix (chunked prefill).

Grid (query tiles, num_seqs, num_kv_heads). A program takes ``TOKENS`` consecutive query tokens of one
request and packs them with all ``GROUP`` query heads of one KV head into the rows of one tile
(row r = token r // GROUP, head r % GROUP), so every K/V tile read from the paged cache serves the
whole GQA group. Query token t of request b sits at absolute position ``context_len + t`` and attends
causally to the request's cached keys (the prefix plus this forward's own tokens, already stored),
restricted to ``(p - window, p]`` under a sliding window: key tiles wholly before the window of the
tile's first token are skipped. The same kernel serves mixed batches (decode tokens are 1-token
chunks), so it is the route for every batch that is not pure decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mmlora.backends.triton_common import cdiv, next_pow2
from mmlora.forward.lora import length_tiles
from mmlora.layers.attention.triton_common import attend_key_tile, dot_precision, dot_upcast, softmax_args
from mmlora.triton_launch import fast


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    tile_seq_ptr, tile_t0_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_bt,
    mult, cap_mult, window,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    TILED: tl.constexpr,
):  # fmt: skip
    kvh = tl.program_id(2)
    if TILED:  # tile i: request tile_seq[i], first query token tile_t0[i] (CUDA graphs: a fixed grid)
        b = tl.load(tile_seq_ptr + tl.program_id(0))
        t0 = tl.load(tile_t0_ptr + tl.program_id(0))
    else:
        b = tl.program_id(1)
        t0 = tl.program_id(0) * TOKENS
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    if t0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = t0 + rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    row_mask = (rows < TOKENS * GROUP) & (tok < q_len)
    d_mask = offs_d < HEAD_DIM
    pos = ctx + tok
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    hi = ctx + tl.minimum(t0 + TOKENS, q_len)  # one past the last key any row of this tile may see
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx + t0 - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    for s0 in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = attend_key_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, s0, hi, pos, window, kvh,
            stride_cs, stride_ch, offs_n, offs_d, d_mask, mult, cap_mult,
            PAGE, USE_SOFTCAP, True, USE_WINDOW, DOT_PREC, UPCAST,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=q_mask,
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    num_seqs: int,
    max_query_len: int,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    tiles: PrefillTiles | None = None,
) -> None:
    """out[t, h] = causal softmax-attention of query token t over its request's cached keys.

    q, out [T, Hq, D] (last dim contiguous); k_cache/v_cache [N, page, Hkv, D] contiguous, already
    holding this forward's K/V; block_tables [>= num_seqs, M] int32; query_start_loc [num_seqs + 1]
    and seq_lens [num_seqs] int32 on the device; max_query_len a host int that sizes the grid. With
    ``tiles`` the grid is instead the table's ``count`` query tiles (:func:`prefill_tile_table`), so it
    depends on no batch (CUDA graphs of mixed steps).
    """
    _, page, hkv, d = k_cache.shape
    group = q.shape[1] // hkv
    block_m, block_n, tokens = _tile_shape(group, d)
    block_d = next_pow2(d)
    mult, cap_mult = softmax_args(scale, logit_softcap)
    kc = k_cache.view(-1, hkv, d)
    if tiles is None:
        grid = (cdiv(max_query_len, tokens), num_seqs, hkv)
        tile_seq = tile_t0 = query_start_loc  # unread
    else:
        if tiles.tokens != tokens:
            raise ValueError(
                f"the tile table has {tiles.tokens} tokens a tile, this attention takes {tokens}"
            )
        grid = (tiles.count, 1, hkv)
        tile_seq, tile_t0 = tiles.seq, tiles.t0
    fast(_prefill_kernel)[grid](
        q, kc, v_cache.view(-1, hkv, d), out, block_tables, query_start_loc, seq_lens, tile_seq, tile_t0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kc.stride(0), kc.stride(1),
        block_tables.stride(0),
        mult, cap_mult, sliding_window or 0,
        GROUP=group, TOKENS=tokens, HEAD_DIM=d, BLOCK_D=block_d, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
        USE_SOFTCAP=bool(logit_softcap), USE_WINDOW=bool(sliding_window),
        DOT_PREC=dot_precision(q.dtype), UPCAST=dot_upcast(q.dtype), TILED=tiles is not None,
        num_warps=4 if block_m <= 64 else 8, num_stages=2,
    )  # fmt: skip


def _tile_shape(group: int, head_dim: int) -> tuple[int, int, int]:
    """(rows, key tile, query tokens) of a program: rows = tokens x group heads; head_dim 256 takes
    smaller tiles to stay within registers."""
    block_m = max(128 if next_pow2(head_dim) <= 128 else 64, next_pow2(group))
    return block_m, (64 if next_pow2(head_dim) <= 128 else 32), block_m // group


def prefill_tile_tokens(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Query tokens per program of the prefill kernel for this head layout."""
    return _tile_shape(num_heads // num_kv_heads, head_dim)[2]


@dataclass
class PrefillTiles:
    """A fixed-size table of query tiles: tile i covers ``tokens`` query tokens of request ``seq[i]`` from
    ``t0[i]``; the first ``count`` entries are launched (unused ones start past their request and exit)."""

    seq: torch.Tensor  # int32 [>= count]
    t0: torch.Tensor  # int32 [>= count]
    count: int
    tokens: int


def prefill_tile_table(query_lens: list[int], tokens: int, count: int) -> tuple[list[int], list[int]]:
    """(seq, t0) lists of ``count`` entries: each request's query tiles in order (t0 from the request's
    first query token), then unused entries that exit at once. A ValueError when the batch has more tiles
    than ``count``."""
    return length_tiles(query_lens, tokens, count, absolute=False)
