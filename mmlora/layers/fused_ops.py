"""Fused elementwise and norm ops of the decoder layers: RMSNorm (with the residual add) and the SiLU/GELU-
gated MLP activations (rotary embedding of q and k, built the same way: :mod:`mmlora.layers.rotary_ops`).

Each op comes three ways: a pure-torch reference (``*_ref``, the exact arithmetic the models used before
these kernels, kept bit for bit), a Triton launch (``*_triton``, one kernel launch), and a dispatch
(``rms_norm``, ``silu_and_mul``, ``gelu_tanh_and_mul``) that runs Triton on CUDA tensors and the
reference everywhere else. The kernels round where the reference rounds (to the input
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
from mmlora.backends.triton_common import cdiv, gated_act, next_pow2, pdl_launch, pdl_options
from mmlora.backends.triton_sgmv_tuning import TUNING as SGMV_TUNING
from mmlora.triton_launch import fast

#: Launch heuristics (read at every launch, so a benchmark can sweep them): the widest row RMSNorm keeps
#: in registers in one tile (wider rows loop over tiles of this width, reading the row twice), and
#: columns per program of the gated activations and their warps.
TUNING = {"norm_max_block": 16384, "act_block": 1024, "act_warps": 4}

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
    PDL: tl.constexpr,
):  # fmt: skip
    """RMSNorm of one row per program, optionally after a residual add:
    ``s = x + r`` (rounded to x.dtype; stored to S), ``y = s * rsqrt(mean(s^2) + eps)`` scaled by the
    weight as :func:`_rms_norm_scale` says.

    x, r, s [rows, N] (same dtype: fp32/fp16/bf16, unit column stride), w [N], y [rows, N] in y's
    dtype. Statistics in fp32. N <= BLOCK * NUM_TILES; with NUM_TILES > 1 the row is read twice. PDL:
    launched as a programmatic dependent of the kernel before it, which it waits for first.
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
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
    gu_ptr, out_ptr, N_INTER, stride_g, stride_o, ACT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Gated activation: ``out[t, j] = round(act(gate[t, j])) * up[t, j]`` with gate = gu[t, :I] and
    up = gu[t, I:2I], I = N_INTER; act is SiLU (ACT 0) or tanh-approximated GELU (ACT 1), in fp32.

    gu [T, 2I], out [T, I], same dtype (fp32/fp16/bf16), unit column stride. act(gate) is rounded to
    the dtype before the product, as torch's ``act(gate) * up`` rounds. Program (t, j-block). PDL: as in
    ``_rms_norm_kernel``.
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N_INTER
    g_row = gu_ptr + t * stride_g
    g = tl.load(g_row + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(g_row + N_INTER + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, gated_act(g, u, ACT, out_ptr.dtype.element_ty), mask=ok)


def dependent_launch(device: torch.device) -> dict:
    """Launch options of a fused op that may read a decode-run LoRA expand's output: with SGMV's
    ``TUNING["expand_dependents"]`` on Hopper, a programmatic dependent launch (``PDL``: the kernel waits for
    the one before it before reading anything); else a plain launch."""
    return pdl_options(pdl_launch(device, SGMV_TUNING["expand_dependents"]))


# ---- checks ---------------------------------------------------------------------------------------


def check_dtype(name: str, t: torch.Tensor) -> None:
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


def unit_cols(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride in its last dim (a copy only when it has none)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def same_device(name: str, *ts: torch.Tensor) -> None:
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
    same_device("rms_norm", x, weight, *(() if residual is None else (residual,)))
    check_dtype("rms_norm: x", x)
    check_dtype("rms_norm: weight", weight)
    N = x.shape[-1]
    x2 = unit_cols(x.reshape(-1, N))
    rows = x2.shape[0]
    y_dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty((rows, N), dtype=y_dtype, device=x.device)
    if residual is None:
        r2 = s = x2  # unused by the kernel (HAS_RESIDUAL False)
    else:
        r2 = unit_cols(residual.reshape(-1, N))
        s = torch.empty((rows, N), dtype=x.dtype, device=x.device)
    if rows and N:
        block = block or min(next_pow2(N), TUNING["norm_max_block"])
        tiles = cdiv(N, block)
        fast(_rms_norm_kernel)[(rows,)](
            x2, r2, weight, y, s,
            N, x2.stride(0), r2.stride(0), y.stride(0), s.stride(0), float(eps), float(offset),
            HAS_RESIDUAL=residual is not None, GEMMA=bool(offset), BLOCK=block, NUM_TILES=tiles,
            num_warps=min(16, max(1, block // 512)), **dependent_launch(x.device),
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
    check_dtype(f"{name}: gate_up", gate_up)
    g2 = unit_cols(gate_up.reshape(-1, 2 * inter))
    out = torch.empty((g2.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if g2.shape[0] and inter:
        block = min(next_pow2(inter), TUNING["act_block"])
        grid = (g2.shape[0], cdiv(inter, block))
        fast(_act_and_mul_kernel)[grid](
            g2, out, inter, g2.stride(0), out.stride(0), ACT=act, BLOCK=block, num_warps=TUNING["act_warps"],
            **dependent_launch(g2.device),
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
