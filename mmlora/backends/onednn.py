"""Prepacked matmuls on CPU: the primitive under ``PackedLinear`` and torch-gather's CPU decode path.

A CPU decode step is a few hundred thin GEMMs. ``F.linear`` / ``mm`` hand the plain row-major weight to
the BLAS on every call, which re-blocks it each time; a prepacked weight is blocked once
(:func:`pack_weight`) and multiplied directly (:func:`packed_matmul`). Two implementations sit behind that
pair: the C panel GEMM of :mod:`mmlora.backends.cpu_gemm` where the C kernels are built (fp32, and bf16 on
CPUs with AVX-512 BF16), else oneDNN's prepacked linear. oneDNN costs about 25 us a call before it
computes; on issue 21's 2-core EPYC a SmolLM2 decode forward took 0.76-0.80x the time with the C GEMM
(``benchmarks/scripts/cpu_gemm_ab.py``: fp32 57.6 -> 45.5 ms, bf16 50.1 -> 37.9 ms, interleaved).

oneDNN builds and caches one primitive per input row count, about 0.5 MB each (measured: 2,048 distinct
row counts through four layers grew RSS by 1 GB). So only inputs of at most :data:`PACKED_MAX_ROWS` rows
take the packed path (decode-sized, where it pays), padded up to a power of two: a handful of primitives
per weight shape, all built in the first steps. The C GEMM takes any row count as it comes.

bf16 pays only where the CPU multiplies it natively (AVX-512 BF16 or AMX-BF16); elsewhere torch converts
bf16 to fp32 in software. :func:`packable_dtypes` says which dtypes pay on this CPU.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from mmlora.backends import cpu_gemm

#: Weights packed from now on go to the C panel GEMM where it is built (``MMLORA_CPU_GEMM=0``: oneDNN's);
#: A/B scripts flip it before building an engine.
PANEL_GEMM = os.environ.get("MMLORA_CPU_GEMM", "1") != "0"
#: Inputs of more rows are not packed; fewer are padded to the next power of two (see above).
PACKED_MAX_ROWS = 64
#: /proc/cpuinfo flags that mean native bf16 dot products.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def onednn_linear_available() -> bool:
    """Whether this torch build has the oneDNN prepacked-linear ops."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def _panel_gemm_takes(dtype: torch.dtype) -> bool:
    return PANEL_GEMM and dtype in cpu_gemm.dtypes()


def packed_matmul_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`pack_weight` can pack a weight of ``dtype`` here: the C panel GEMM takes it, or this
    torch build has oneDNN's prepacked linear."""
    return _panel_gemm_takes(dtype) or onednn_linear_available()


@functools.cache
def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The :data:`BF16_FLAGS` this CPU reports (empty where /proc/cpuinfo is missing: not Linux)."""
    path = Path(cpuinfo)
    if not path.is_file():
        return frozenset()
    for line in path.read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(BF16_FLAGS) & frozenset(line.split(":", 1)[1].split())
    return frozenset()


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes whose packed matmuls pay on this CPU: fp32, and bf16 where it is native."""
    return (torch.float32, torch.bfloat16) if cpu_bf16_flags() else (torch.float32,)


def pack_weight(weight: torch.Tensor, batch_size: int | None = None) -> torch.Tensor | cpu_gemm.PanelWeight:
    """``weight`` [out, in] (CPU, fp32/bf16) packed for :func:`packed_matmul`: for the C panel GEMM
    (:mod:`mmlora.backends.cpu_gemm`) where it is built for the dtype and :data:`PANEL_GEMM` is on, else
    in oneDNN's blocked layout, an opaque tensor (``batch_size``: the row count to tune it for, None: any).
    Either has the weight's ``dtype``."""
    if weight.device.type == "cpu" and _panel_gemm_takes(weight.dtype):
        return cpu_gemm.pack(weight)
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size)


def row_bucket(rows: int) -> int:
    """The row count a packed matmul of ``0 < rows <= PACKED_MAX_ROWS`` rows runs at: the next power of two."""
    return 1 << (rows - 1).bit_length()


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, in] with zero rows appended up to :func:`row_bucket` rows (``x`` itself when none are)."""
    rows = x.shape[0]
    bucket = row_bucket(rows)
    return x if bucket == rows else torch.cat([x, x.new_zeros(bucket - rows, x.shape[1])])


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for x [rows, in] with ``0 < rows <= PACKED_MAX_ROWS`` (any count:
    :func:`packed_matmul_rows`), W packed by
    :func:`pack_weight` (same dtype as x); returns [rows, out]. For oneDNN, rows are padded with zeros up
    to a power of two (their outputs dropped), which leaves the real rows' values unchanged."""
    if type(packed) is cpu_gemm.PanelWeight:
        return cpu_gemm.matmul_unchecked(x if x.stride(-1) == 1 else x.contiguous(), packed, bias)
    rows = x.shape[0]
    out = torch.ops.mkldnn._linear_pointwise(pad_rows(x), packed, bias, "none", [], "")
    return out if out.shape[0] == rows else out[:rows]


def packed_matmul_rows(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`packed_matmul` for any row count above 0 (prefill too): the C panel GEMM takes every row in one
    call (each panel is read once for all of them); oneDNN's runs in ``PACKED_MAX_ROWS``-row pieces (it
    builds a primitive per row count)."""
    if type(packed) is cpu_gemm.PanelWeight or x.shape[0] <= PACKED_MAX_ROWS:
        return packed_matmul(x, packed, bias)
    return torch.cat([packed_matmul(piece, packed, bias) for piece in x.split(PACKED_MAX_ROWS)])
