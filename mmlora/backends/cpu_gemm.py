"""The C panel GEMM of the CPU decode step (``cpu_gemm.c``, built with :mod:`mmlora.backends.cpu_kernels`):
``y = x W^T + bias`` for a few rows of x, with W prepacked once into column panels (:func:`pack`).

A SmolLM2 decode step makes about 120 such calls of 16 rows each. oneDNN's prepacked matmul costs about
25 us a call before it computes (a 16 x 128 x 384 product takes 33 us where its arithmetic is 8), about
3 ms of a 50 ms step; this one is a ctypes call, a copy of x into the kernel's row layout, and one
OpenMP region over the panels. It runs on torch's OpenMP threads. Tested against a float64 reference in
``tests/kernels/test_cpu_gemm.py``.
"""

from __future__ import annotations

import functools

import torch

from mmlora.backends.cpu_kernels import _library, available


@functools.cache
def _functions() -> tuple | None:
    """(gemm_f32, gemm_bf16 or None, panel width), or None where the C kernels are not built."""
    lib = _library()
    if lib is None:
        return None
    # (argument types: set where the library is loaded)
    return lib.gemm_f32, lib.gemm_bf16 if lib.gemm_has_bf16() else None, int(lib.gemm_panel_width())


def dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes :func:`pack` takes here (none where the C kernels are off or not built)."""
    fns = _functions() if available() else None
    if fns is None:
        return ()
    return (torch.float32, torch.bfloat16) if fns[1] is not None else (torch.float32,)


class PanelWeight:
    """A weight [out, in] packed by :func:`pack` for :func:`matmul`: ``data`` [panels, in, NR] in fp32 (NR
    the kernel's panel width), [panels, ceil(in / 2), 16, 2] in bf16 (pairs along ``in``), zero past ``out``
    columns and ``in`` rows; ``dtype`` is the weight's."""

    __slots__ = ("data", "out_features", "in_features")

    def __init__(self, data: torch.Tensor, out_features: int, in_features: int) -> None:
        self.data, self.out_features, self.in_features = data, out_features, in_features

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def pack(weight: torch.Tensor) -> PanelWeight:
    """``weight`` [out, in] (CPU, a dtype of :func:`dtypes`) in the kernel's panel layout."""
    if weight.dim() != 2 or weight.dtype not in dtypes() or weight.device.type != "cpu":
        raise ValueError(f"cpu_gemm.pack: weight {tuple(weight.shape)} {weight.dtype} on {weight.device}")
    bf16 = weight.dtype == torch.bfloat16
    nr = 16 if bf16 else _functions()[2]
    out_features, in_features = weight.shape
    panels, depth = -(-out_features // nr), in_features + (in_features % 2 if bf16 else 0)
    with torch.no_grad():
        padded = weight.detach().new_zeros(panels * nr, depth)
        padded[:out_features, :in_features] = weight.detach()
        if bf16:
            data = padded.view(panels, nr, depth // 2, 2).permute(0, 2, 1, 3).contiguous()
        else:
            data = padded.view(panels, nr, depth).transpose(1, 2).contiguous()
    return PanelWeight(data, out_features, in_features)


def matmul(x: torch.Tensor, w: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for x [rows, in] (unit column stride, W's dtype), bias [out] contiguous or None;
    returns a new [rows, out]."""
    rows = x.shape[0]
    if x.dim() != 2 or x.shape[1] != w.in_features or x.dtype != w.dtype or (rows and x.stride(1) != 1):
        raise ValueError(
            f"cpu_gemm.matmul: x {tuple(x.shape)} {x.dtype} against W [{w.out_features}, {w.in_features}]"
        )
    if bias is not None and (
        bias.shape != (w.out_features,) or bias.dtype != w.dtype or not bias.is_contiguous()
    ):
        raise ValueError(f"cpu_gemm.matmul: bias {tuple(bias.shape)} {bias.dtype}")
    return matmul_unchecked(x, w, bias)


def matmul_unchecked(x: torch.Tensor, w: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`matmul` without its checks."""
    rows = x.shape[0]
    y = torch.empty(rows, w.out_features, dtype=x.dtype)
    if rows == 0:
        return y
    fn = _functions()[x.dtype == torch.bfloat16]
    status = fn(rows, w.out_features, w.in_features, x.data_ptr(), x.stride(0), w.data.data_ptr(),
                None if bias is None else bias.data_ptr(), y.data_ptr(), w.out_features,
                torch.get_num_threads())  # fmt: skip
    if status:
        raise MemoryError("cpu_gemm.matmul: no memory for the kernel's row buffer")
    return y
