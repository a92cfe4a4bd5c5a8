"""Fused elementwise and norm ops of the decoder layers: RMSNorm (with the residual add), SiLU/GELU-gated
MLP activations, and rotary embedding of q and k.

Each op comes three ways: a pure-torch reference (``*_ref``, the exact arithmetic the models used before
these kernels, kept bit for bit), a Triton launch (``*_triton``, one kernel launch), and a dispatch
(``rms_norm``, ``silu_and_mul``, ``gelu_tanh_and_mul``, ``apply_rotary``) that runs Triton on CUDA
tensors and the reference everywhere else. The kernels round where the reference rounds (to the input
dtype after each op that torch computes in the input dtype), so fp16/bf16 results match the reference
bit for bit except where fp32 reductions or exp differ in their last bit.

Launches allocate only shape-sized outputs and take their grids from shapes, so they are capturable in
CUDA graphs. Inference only: the Triton path has no autograd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmlora.backends import cpu_kernels
from mmlora.backends.base import DeferredLoRA
from mmlora.backends.triton_common import cdiv, gated_act, next_pow2
from mmlora.triton_launch import fast

#: Launch heuristics (read at every launch, so a benchmark can sweep them): the widest row RMSNorm keeps
#: in registers in one tile (wider rows loop over tiles of this width, reading the row twice), columns
#: per program of the gated activations and their warps, and elements (heads x half head_dim) per rotary
#: program and its warps.
TUNING = {
    "norm_max_block": 16384,
    "act_block": 1024,
    "act_warps": 4,
    "rope_tile": 1024,
    "rope_warps": 4,
}

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)
_SILU, _GELU_TANH = 0, 1


# ---- kernels --------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_row(x_row, r_row, s_row, cols, ok, HAS_RESIDUAL: tl.constexpr, STORE_S: tl.constexpr):
    """Loads x as fp32; with HAS_RESIDUAL, x + r rounded to x's dtype (stored to s when STORE_S)."""
    x = tl.load(x_row + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(r_row + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        if STORE_S:
            tl.store(s_row + cols, x, mask=ok)
    return x.to(tl.float32)


@triton.jit
def _rms_norm_scale(xn, w_ptr, cols, ok, offset, X_DTYPE: tl.constexpr, GEMMA: tl.constexpr):
    """The weight step: Gemma ``xn * (offset + w)`` in fp32; Llama ``w * round(xn)`` (rounded to X_DTYPE)."""
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if GEMMA:
        return xn * (offset + w)
    return xn.to(X_DTYPE).to(tl.float32) * w


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, s_ptr,
    N, stride_x, stride_r, stride_y, stride_s, eps, offset,
    HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):  # fmt: skip
    """RMSNorm of one row per program, optionally after a residual add:
    ``s = x + r`` (rounded to x.dtype; stored to S), ``y = s * rsqrt(mean(s^2) + eps)`` scaled by the
    weight as :func:`_rms_norm_scale` says.

    x, r, s [rows, N] (same dtype: fp32/fp16/bf16, unit column stride), w [N], y [rows, N] in y's
    dtype. Statistics in fp32. N <= BLOCK * NUM_TILES; with NUM_TILES > 1 the row is read twice.
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    s_row = s_ptr + row * stride_s
    y_row = y_ptr + row * stride_y
    if NUM_TILES == 1:
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        xf = _rms_norm_row(x_row, r_row, s_row, cols, ok, HAS_RESIDUAL, True)
        inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        y = _rms_norm_scale(xf * inv, w_ptr, cols, ok, offset, x_ptr.dtype.element_ty, GEMMA)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(NUM_TILES):
            cols = i * BLOCK + tl.arange(0, BLOCK)
            ok = cols < N
            xf = _rms_norm_row(x_row, r_row, s_row, cols, ok, HAS_RESIDUAL, True)
            acc += xf * xf
        inv = tl.math.rsqrt(tl.sum(acc, axis=0) / N + eps)
        for i in range(NUM_TILES):
            cols = i * BLOCK + tl.arange(0, BLOCK)
            ok = cols < N
            xf = _rms_norm_row(x_row, r_row, s_row, cols, ok, HAS_RESIDUAL, False)  # recomputes the same s
            y = _rms_norm_scale(xf * inv, w_ptr, cols, ok, offset, x_ptr.dtype.element_ty, GEMMA)
            tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _act_and_mul_kernel(
    gu_ptr, out_ptr, N_INTER, stride_g, stride_o, ACT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Gated activation: ``out[t, j] = round(act(gate[t, j])) * up[t, j]`` with gate = gu[t, :I] and
    up = gu[t, I:2I], I = N_INTER; act is SiLU (ACT 0) or tanh-approximated GELU (ACT 1), in fp32.

    gu [T, 2I], out [T, I], same dtype (fp32/fp16/bf16), unit column stride. act(gate) is rounded to
    the dtype before the product, as torch's ``act(gate) * up`` rounds. Program (t, j-block).
    """
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N_INTER
    g_row = gu_ptr + t * stride_g
    g = tl.load(g_row + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(g_row + N_INTER + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, gated_act(g, u, ACT, out_ptr.dtype.element_ty), mask=ok)


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
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rotary embedding, neox layout, of q and k in one launch: for x in (q, k), with D = 2 * HALF,
    ``out[t, h] = round(x[t, h] * cos[t]) + round(rotate_half(x[t, h]) * sin[t])`` (rounded to x.dtype).

    q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D], outputs like q and k; one dtype (fp32/fp16/bf16), any
    token and head strides, unit column stride. Program (t, head block): blocks below Q_BLOCKS are q's.
    """
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


# ---- checks ---------------------------------------------------------------------------------------


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _SUPPORTED:
        raise ValueError(f"{name}: dtype {t.dtype} is not supported (float32, float16, bfloat16)")


def _check_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not fit x {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x "
            f"{tuple(x.shape)} {x.dtype}"
        )


def _check_gate_up(name: str, gate_up: torch.Tensor) -> int:
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(
            f"{name}: gate_up last dim must be even (gate | up), got shape {tuple(gate_up.shape)}"
        )
    return gate_up.shape[-1] // 2


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


def _unit_cols(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride in its last dim (a copy only when it has none)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _same_device(name: str, *ts: torch.Tensor) -> None:
    if len({t.device for t in ts}) != 1:
        raise ValueError(f"{name}: tensors are on different devices {[str(t.device) for t in ts]}")


# ---- RMSNorm --------------------------------------------------------------------------------------


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch RMSNorm (see :func:`rms_norm`), the arithmetic of the models before the fused kernels."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        # Gemma multiplies in fp32 before casting back.
        y = (xf * (offset + weight.float())).to(dtype)
    else:
        y = weight * xf.to(dtype)
    return y if residual is None else (y, x)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
    block: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` in one Triton launch. ``block`` overrides the tile width (tests: multi-tile rows)."""
    _check_norm(x, weight, residual)
    _same_device("rms_norm", x, weight, *(() if residual is None else (residual,)))
    _check_dtype("rms_norm: x", x)
    _check_dtype("rms_norm: weight", weight)
    N = x.shape[-1]
    x2 = _unit_cols(x.reshape(-1, N))
    rows = x2.shape[0]
    y_dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty((rows, N), dtype=y_dtype, device=x.device)
    if residual is None:
        r2 = s = x2  # unused by the kernel (HAS_RESIDUAL False)
    else:
        r2 = _unit_cols(residual.reshape(-1, N))
        s = torch.empty((rows, N), dtype=x.dtype, device=x.device)
    if rows and N:
        block = block or min(next_pow2(N), TUNING["norm_max_block"])
        tiles = cdiv(N, block)
        fast(_rms_norm_kernel)[(rows,)](
            x2, r2, weight, y, s,
            N, x2.stride(0), r2.stride(0), y.stride(0), s.stride(0), float(eps), float(offset),
            HAS_RESIDUAL=residual is not None, GEMMA=bool(offset), BLOCK=block, NUM_TILES=tiles,
            num_warps=min(16, max(1, block // 512)),
            enable_fp_fusion=False,  # x^2 rounded before the sum, as torch's pow then mean
        )  # fmt: skip
    y = y.view(x.shape)
    return y if residual is None else (y, s.view(x.shape))


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim: ``y = x * rsqrt(mean(x^2) + eps)`` (fp32 statistics) times
    ``offset + weight``. Offset 0 (Llama): y rounded to x.dtype, then times the weight in the weight's
    and x's promoted dtype. Offset != 0 (Gemma, weight stored as w - 1): the product in fp32, rounded
    to x.dtype.

    With ``residual`` (same shape and dtype as x): ``s = x + residual`` rounded to x.dtype, and the
    result is ``(RMSNorm(s), s)``, the fused residual pattern of vLLM's decoder layers. Triton on
    CUDA, torch elsewhere.
    """
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps, offset, residual)
    _check_norm(x, weight, residual)
    return rms_norm_ref(x, weight, eps, offset, residual)


# ---- gated activations ----------------------------------------------------------------------------


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch ``silu(gate) * up`` over gate_up = [..., gate | up]."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch ``gelu(gate, approximate="tanh") * up`` over gate_up = [..., gate | up]."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def _act_and_mul_triton(name: str, gate_up: torch.Tensor, act: int) -> torch.Tensor:
    inter = _check_gate_up(name, gate_up)
    _check_dtype(f"{name}: gate_up", gate_up)
    g2 = _unit_cols(gate_up.reshape(-1, 2 * inter))
    out = torch.empty((g2.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if g2.shape[0] and inter:
        block = min(next_pow2(inter), TUNING["act_block"])
        grid = (g2.shape[0], cdiv(inter, block))
        fast(_act_and_mul_kernel)[grid](
            g2, out, inter, g2.stride(0), out.stride(0), ACT=act, BLOCK=block, num_warps=TUNING["act_warps"],
            enable_fp_fusion=True,  # fma inside act, as nvcc builds torch's own activation kernels
        )  # fmt: skip
    return out.view(*gate_up.shape[:-1], inter)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_and_mul` in one Triton launch."""
    return _act_and_mul_triton("silu_and_mul", gate_up, _SILU)


def gelu_tanh_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`gelu_tanh_and_mul` in one Triton launch."""
    return _act_and_mul_triton("gelu_tanh_and_mul", gate_up, _GELU_TANH)


def _with_lora(gate_up: torch.Tensor, lora: DeferredLoRA, act: int) -> torch.Tensor | None:
    """The activation with gate_up's deferred LoRA delta fused in where the delta can (None: it has been
    added to gate_up in place instead, and the plain activation follows)."""
    fused = lora.act_and_mul(gate_up, act)
    if fused is None:
        lora.apply(gate_up)
    return fused


def silu_and_mul(gate_up: torch.Tensor, lora: DeferredLoRA | None = None) -> torch.Tensor:
    """gate_up [..., 2I] -> ``silu(gate) * up`` [..., I] in gate_up's dtype. Triton on CUDA; on CPU one C call
    where the kernels are built (fp32 / bf16, no autograd: :func:`mmlora.backends.cpu_kernels.silu_and_mul`),
    else torch. ``lora``: gate_up's LoRA delta, deferred by its layer (``LoRALinear.forward_deferred``),
    added to gate and up first (gate_up [T, 2I] then)."""
    if lora is not None and (fused := _with_lora(gate_up, lora, _SILU)) is not None:
        return fused
    if gate_up.is_cuda:
        return silu_and_mul_triton(gate_up)
    _check_gate_up("silu_and_mul", gate_up)
    if (
        gate_up.device.type == "cpu"
        and gate_up.dtype in cpu_kernels.ELEMENTWISE_DTYPES
        and not (torch.is_grad_enabled() and gate_up.requires_grad)
        and cpu_kernels.available()
    ):
        return cpu_kernels.silu_and_mul_unchecked(gate_up)
    return silu_and_mul_ref(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor, lora: DeferredLoRA | None = None) -> torch.Tensor:
    """gate_up [..., 2I] -> ``gelu(gate, approximate="tanh") * up`` [..., I] in gate_up's dtype.
    Triton on CUDA, torch elsewhere. ``lora``: as for :func:`silu_and_mul`."""
    if lora is not None and (fused := _with_lora(gate_up, lora, _GELU_TANH)) is not None:
        return fused
    if gate_up.is_cuda:
        return gelu_tanh_and_mul_triton(gate_up)
    _check_gate_up("gelu_tanh_and_mul", gate_up)
    return gelu_tanh_and_mul_ref(gate_up)


# ---- rotary ---------------------------------------------------------------------------------------


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
    _same_device("apply_rotary", q, k, cos, sin)
    _check_dtype("apply_rotary: q", q)
    q, k, cos, sin = (_unit_cols(t) for t in (q, k, cos, sin))
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
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=TUNING["rope_warps"],
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
