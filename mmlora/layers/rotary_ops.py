"""Rotary embedding of q and k (neox layout) as one fused op, built like :mod:`mmlora.layers.fused_ops`:
a pure-torch reference (:func:`apply_rotary_ref`, the models' arithmetic before the kernel, kept bit for
bit), one Triton launch for q and k (:func:`apply_rotary_triton`), and a dispatch (:func:`apply_rotary`)
that runs Triton on CUDA tensors and the reference everywhere else. The kernel rounds each product to
the input dtype before the sum, as torch does, so its results equal the reference's.

The launch allocates only shape-sized outputs and takes its grid from shapes, so it is capturable in
CUDA graphs. Inference only: the Triton path has no autograd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmlora.backends.triton_common import cdiv, next_pow2
from mmlora.layers.fused_ops import check_dtype, dependent_launch, same_device, unit_cols
from mmlora.triton_launch import fast

#: Launch heuristics (read at every launch, so a benchmark can sweep them): elements (heads x half
#: head_dim) per program, and its warps.
TUNING = {"rope_tile": 1024, "rope_warps": 4}


# ---- kernel ---------------------------------------------------------------------------------------


@triton.jit
def _rope_heads(
    src, dst, c_row, s_row, h0, H, stride_h, stride_dh, HALF, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Rotates heads h0 .. h0 + BLOCK_H - 1 (< H) of one token: neox layout, halves of HALF columns."""
    heads = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    ok = (heads < H)[:, None] & d_ok[None, :]
    c1 = tl.load(c_row + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_row + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_row + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_row + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    p = src + heads[:, None] * stride_h + d[None, :]
    x1 = tl.load(p, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=ok, other=0.0).to(tl.float32)
    dtype = dst.dtype.element_ty
    # Each product is rounded to the dtype before the sum, as torch's q * cos + rotate_half(q) * sin.
    o1 = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    o2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    o = dst + heads[:, None] * stride_dh + d[None, :]
    tl.store(o, o1.to(dtype), mask=ok)
    tl.store(o + HALF, o2.to(dtype), mask=ok)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
    Hq, Hkv, HALF, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    stride_qot, stride_qoh, stride_kot, stride_koh, Q_BLOCKS,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Rotary embedding, neox layout, of q and k in one launch: for x in (q, k), with D = 2 * HALF,
    ``out[t, h] = round(x[t, h] * cos[t]) + round(rotate_half(x[t, h]) * sin[t])`` (rounded to x.dtype).

    q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D], outputs like q and k; one dtype (fp32/fp16/bf16), any
    token and head strides, unit column stride. Program (t, head block): blocks below Q_BLOCKS are q's.
    PDL: launched as a programmatic dependent of the kernel before it, which it waits for first.
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    c_row = cos_ptr + t * stride_ct
    s_row = sin_ptr + t * stride_st
    if hb < Q_BLOCKS:
        _rope_heads(
            q_ptr + t * stride_qt, qo_ptr + t * stride_qot, c_row, s_row, hb * BLOCK_H, Hq,
            stride_qh, stride_qoh, HALF, BLOCK_H, BLOCK_D,
        )  # fmt: skip
    else:
        _rope_heads(
            k_ptr + t * stride_kt, ko_ptr + t * stride_kot, c_row, s_row, (hb - Q_BLOCKS) * BLOCK_H, Hkv,
            stride_kh, stride_koh, HALF, BLOCK_H, BLOCK_D,
        )  # fmt: skip


# ---- checks and launch -----------------------------------------------------------------------------


def _check_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"apply_rotary: q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, D] with one T and D"
        )
    T, _, D = q.shape
    if D % 2:
        raise ValueError(f"apply_rotary: head_dim {D} must be even")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (T, D):
            raise ValueError(f"apply_rotary: {name} shape {tuple(t.shape)} must be [T, D] = [{T}, {D}]")
    if len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1:
        raise ValueError(
            f"apply_rotary: q, k, cos, sin must share one dtype, got {q.dtype}, {k.dtype}, {cos.dtype}, "
            f"{sin.dtype}"
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1 | x2] -> [-x2 | x1] over the last dim (neox layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch neox rotary: ``x * cos + rotate_half(x) * sin`` for x in (q, k), cos/sin broadcast over heads."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary` in one Triton launch for q and k."""
    _check_rotary(q, k, cos, sin)
    same_device("apply_rotary", q, k, cos, sin)
    check_dtype("apply_rotary: q", q)
    q, k, cos, sin = (unit_cols(t) for t in (q, k, cos, sin))
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    qo = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, Hkv, D), dtype=k.dtype, device=k.device)
    if T == 0 or D == 0:
        return qo, ko
    half = D // 2
    block_d = next_pow2(half)
    block_h = max(1, min(TUNING["rope_tile"] // block_d, next_pow2(max(Hq, Hkv))))
    q_blocks = cdiv(Hq, block_h)
    grid = (T, q_blocks + cdiv(Hkv, block_h))
    fast(_rope_kernel)[grid](
        q, k, cos, sin, qo, ko,
        Hq, Hkv, half, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), q_blocks,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=TUNING["rope_warps"], **dependent_launch(q.device),
        enable_fp_fusion=False,  # no fma: fp32 results round like torch's separate multiply and add
    )  # fmt: skip
    return qo, ko


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding of q [T, Hq, D] and k [T, Hkv, D] (any token/head strides, e.g. views of a
    packed qkv output) with per-token cos/sin [T, D] in q's dtype: ``x * cos + rotate_half(x) * sin``,
    each product rounded to the dtype before the sum. Returns new contiguous (q_rot, k_rot). Triton on
    CUDA (one launch for both), torch elsewhere."""
    if q.is_cuda:
        return apply_rotary_triton(q, k, cos, sin)
    _check_rotary(q, k, cos, sin)
    return apply_rotary_ref(q, k, cos, sin)
