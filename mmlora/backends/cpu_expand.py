"""The C LoRA expand of the CPU decode step (:mod:`mmlora.backends.cpu_kernels` builds it): a module's expand
and add, ``y[t, slice i] += h[t, slot(t)'s slice i rows] @ E[those rows, slice i]``, reading only each row's
own slot (the torch path masks the other slots' columns to zero, multiplies every row by every slot's
expand rows and adds: three calls). It runs on torch's OpenMP threads. Tested against a float64 reference
in ``tests/unit/test_cpu_kernels.py``.
"""

from __future__ import annotations

import torch

from mmlora.backends.cpu_kernels import _library, available

#: The dtypes :func:`lora_expand` takes.
EXPAND_DTYPES = (torch.float32, torch.bfloat16)


def expand_rows(token_slots: list[int], ranks: list[int], n_slices: int) -> torch.Tensor:
    """[T, 2] int32 for :func:`lora_expand`: each token's first column in the live rank layout of
    :func:`mmlora.backends.cpu_dense.live_rows` (slot-major: slot s starts at ``n_slices * sum(ranks[:s])``)
    and its slot's rank; (-1, 0) for base-only tokens."""
    starts = [0] * len(ranks)
    for s in range(1, len(ranks)):
        starts[s] = starts[s - 1] + n_slices * ranks[s - 1]
    return torch.tensor(
        [(starts[s], ranks[s]) if s >= 0 else (-1, 0) for s in token_slots], dtype=torch.int32
    ).reshape(-1, 2)


def compact_expand(
    E: torch.Tensor, row_slices: list[int], offsets: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E_compact 1-D, eoff int64 [K]) for :func:`lora_expand`: row k of E [K, out] cut to its slice's
    columns ``offsets[row_slices[k]] : offsets[row_slices[k] + 1]`` (the rest of an expand matrix row is
    zeros), the rows one after another; eoff[k] is where row k starts."""
    parts, eoff, at = [], [], 0
    for k, i in enumerate(row_slices):
        lo, hi = offsets[i], offsets[i + 1]
        parts.append(E[k, lo:hi])
        eoff.append(at)
        at += hi - lo
    flat = torch.cat(parts) if parts else E.new_zeros(0)
    return flat.contiguous(), torch.tensor(eoff, dtype=torch.int64)


def live_row_slices(n_slices: int, ranks: list[int]) -> list[int]:
    """The slice of each row of the live rank layout (:func:`mmlora.backends.cpu_dense.live_rows`'s
    order: slot, then slice, then rank row)."""
    return [i for r in ranks for i in range(n_slices) for _ in range(r)]


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    E: torch.Tensor,
    eoff: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """``y[t, lo_i:hi_i] += h[t, c_t + i r_t : c_t + (i+1) r_t] @ W[same rows, lo_i:hi_i]`` for every
    token t with ``rows[t] = (c_t, r_t)``, c_t >= 0 (:func:`expand_rows`), slice i of ``offsets``
    (int64 [n + 1]); base-only tokens untouched. W [K, out] is the expand matrix, given compact as
    (E, eoff) by :func:`compact_expand`.

    y [T, out], h [T, K]: CPU, one dtype of :data:`EXPAND_DTYPES` (E too), unit column stride (rows may be
    strided: y and h may be views of one [T, out + K] tensor). The delta of a slice is summed in fp32
    and (bf16) rounded to bf16 before it is added, as ``y += h @ W`` rounds. Needs :func:`available`.
    """
    T = y.shape[0]
    if h.shape[0] != T or rows.shape != (T, 2) or eoff.shape != (h.shape[1],) or E.dim() != 1:
        raise ValueError(
            f"lora_expand: shapes y {tuple(y.shape)}, h {tuple(h.shape)}, eoff {tuple(eoff.shape)}"
        )
    if not (y.dtype == h.dtype == E.dtype) or y.dtype not in EXPAND_DTYPES:
        raise ValueError(f"lora_expand: dtypes {y.dtype}, {h.dtype}, {E.dtype}")
    if y.stride(1) != 1 or h.stride(1) != 1 or not E.is_contiguous() or not rows.is_contiguous():
        raise ValueError("lora_expand: needs unit column strides and contiguous E and rows")
    if rows.dtype != torch.int32 or eoff.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise ValueError("lora_expand: rows int32, eoff and offsets int64")
    if int(offsets[-1]) > y.shape[1]:
        raise ValueError("lora_expand: offsets past y's columns")
    if not available():
        raise RuntimeError("lora_expand: the CPU kernels are off or could not be built here")
    lora_expand_unchecked(y, h, E, eoff, rows, offsets)


def lora_expand_unchecked(
    y: torch.Tensor,
    h: torch.Tensor,
    E: torch.Tensor,
    eoff: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """:func:`lora_expand` without its checks, for callers whose tensors are right by construction (the
    fused LoRA path goes through :class:`ExpandCall`, which also keeps the pointers)."""
    fn = _expand_fn(y.dtype)
    fn(y.shape[0], h.data_ptr(), h.stride(0), y.data_ptr(), y.stride(0), E.data_ptr(), eoff.data_ptr(),
       rows.data_ptr(), offsets.numel() - 1, offsets.data_ptr(), torch.get_num_threads())  # fmt: skip


def _expand_fn(dtype: torch.dtype):  # noqa: ANN202
    """The compiled expand for ``dtype`` (one of :data:`EXPAND_DTYPES`)."""
    lib = _library()
    return lib.lora_expand_f32 if dtype == torch.float32 else lib.lora_expand_bf16


class ExpandCall:
    """:func:`lora_expand_unchecked` for one module's fixed expand matrix, its pointers taken once (a
    SmolLM2 step makes 120 of these calls, where two column views and their pointers cost as much as
    the C work): ``call(yk, rows)`` adds the expand of ``yk[:, out:]`` to ``yk[:, :out]`` in place, for yk
    [T, out + K] with unit column stride (the stacked GEMM's output) and ``rows`` from :func:`expand_rows`.
    Holds E, eoff and offsets (whose pointers it keeps)."""

    __slots__ = ("_fn", "_keep", "_E", "_eoff", "_offs", "_n", "_h_offset")

    def __init__(self, E: torch.Tensor, eoff: torch.Tensor, offsets: torch.Tensor, out_features: int) -> None:
        self._fn = _expand_fn(E.dtype)
        self._keep = (E, eoff, offsets)
        self._E, self._eoff, self._offs = E.data_ptr(), eoff.data_ptr(), offsets.data_ptr()
        self._n = offsets.numel() - 1
        self._h_offset = out_features * E.element_size()

    def __call__(self, yk: torch.Tensor, rows: torch.Tensor) -> None:
        y, ld = yk.data_ptr(), yk.stride(0)
        self._fn(yk.shape[0], y + self._h_offset, ld, y, ld, self._E, self._eoff, rows.data_ptr(), self._n,
                 self._offs, torch.get_num_threads())  # fmt: skip
