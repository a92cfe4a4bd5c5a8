"""Pieces shared by the Triton attention kernels: score scaling with soft-capping, the online-softmax
step over one key tile of the paged cache, dot precision."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh from exp2 (no tl.tanh in every Triton version, and the interpreter must run it too);
    # saturates cleanly to +-1 when exp2 overflows or underflows.
    e = tl.exp2(x * 2.8853900817779268)  # exp(2x)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def scale_scores(s, mult, cap_mult, USE_SOFTCAP: tl.constexpr):
    """Raw q.k -> base-2 logits: ``s * scale * log2(e)``, or ``cap * tanh(s * scale / cap) * log2(e)``.

    The host passes ``mult = scale * log2(e)`` without soft-capping, else ``mult = scale / cap`` and
    ``cap_mult = cap * log2(e)``.
    """
    if USE_SOFTCAP:
        return _tanh(s * mult) * cap_mult
    return s * mult


@triton.jit
def attend_key_tile(
    q,
    acc,
    m_i,
    l_i,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    s0,
    hi,
    pos,
    window,
    kvh,
    stride_cs,
    stride_ch,
    offs_n,
    offs_d,
    d_mask,
    mult,
    cap_mult,
    PAGE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One step of online softmax over the key tile ``[s0, s0 + BLOCK_N)`` (keys ``>= hi`` masked) of
    one request's paged cache: returns the updated ``(acc, m_i, l_i)`` of the query rows ``q``.

    ``bt_row`` points at the request's block-table row. With ``CAUSAL`` (prefill) row r sees key j only
    where ``j <= pos[r]`` (and ``j > pos[r] - window`` with ``USE_WINDOW``), so a row may see no key of
    a tile; without it (decode: the caller's range is the window already) every key below ``hi``.
    """
    j = s0 + offs_n
    j_mask = j < hi
    blk = tl.load(bt_row + j // PAGE, mask=j_mask, other=0).to(tl.int64)
    kv_off = (blk * PAGE + j % PAGE)[:, None] * stride_cs + kvh * stride_ch + offs_d[None, :]
    kv_mask = j_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    s = scale_scores(s, mult, cap_mult, USE_SOFTCAP)
    if CAUSAL:
        allowed = (j[None, :] <= pos[:, None]) & j_mask[None, :]
        if USE_WINDOW:
            allowed = allowed & (j[None, :] > pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
    else:
        s = tl.where(j_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = m_new  # decode: every tile holds a key below hi (s0 < hi), so m_new is finite
    if CAUSAL:  # a row may have no allowed key in this tile (window, padding rows): no NaN from exp2
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether the kernels cast ``tl.dot`` operands to fp32: under the interpreter, whose bf16 dot
    returns garbage (triton 3.9); on a GPU fp16/bf16 go to the tensor cores as they are."""
    return interpreting() and dtype != torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands are multiplied exactly (no TF32), so fp32 results match the reference tightly."""
    return "ieee" if dtype == torch.float32 or dot_upcast(dtype) else "tf32"


def softmax_args(scale: float, logit_softcap: float | None) -> tuple[float, float]:
    """The (mult, cap_mult) pair ``scale_scores`` expects."""
    log2e = 1.4426950408889634
    if logit_softcap:
        return scale / logit_softcap, logit_softcap * log2e
    return scale * log2e, 0.0
