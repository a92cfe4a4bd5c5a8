"""The per-row C LoRA of a CPU decode step over many adapter slots (``cpu_row_lora.c``, built by
:mod:`mmlora.backends.cpu_kernels`): a shrink and an expand in which each row reads its own slot's A and B
from the adapter pool in place.

torch-gather's dense CPU path (:mod:`mmlora.backends.cpu_dense`) multiplies every row by every slot's live
rank rows: right for a few slots. Past them (more slots than it takes, or a paged pool) its torch path groups
the rows by slot with index tensors made from Python lists inside the forward, which a CPU decode plan
(:mod:`mmlora.backends.cpu_plan`) refuses, so such decode steps would run eagerly (SmolLM2 fp32 on 2 cores,
32 rows on 32 adapters of a 128-slot pool: 566 ms a step against 164 replayed through these kernels,
``benchmarks/scripts/cpu_row_lora_ab.py``). These
kernels are routed by the batch's ``token_slots`` and ``ranks`` tensors instead, which the graph runner keeps
in fixed buffers: one plan replays every mix of adapters of its batch size, and nothing is copied or cached
that a slot load would make stale. Tested against a float64 reference in ``tests/unit/test_cpu_row_lora.py``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from mmlora.backends.cpu_kernels import _library, available
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights

#: The dtypes the kernels take (x, A, h, B and y share one; the sums run in fp32).
ROW_DTYPES = (torch.float32, torch.bfloat16)

#: Set False to keep torch-gather on its torch paths (A/B scripts flip it; plans made meanwhile keep the
#: path they recorded).
ENABLED = True


def _pool_strides(w: torch.Tensor) -> tuple[int, int, int]:
    """(slot stride, page stride (0 unpaged), row stride) of a pool buffer: A [S, (C,) n*U, in] or B
    [S, (C,) out, U]."""
    return w.stride(0), w.stride(1) if w.dim() == 4 else 0, w.stride(-2)


def _pool_rank(w: torch.Tensor, U: int) -> int:
    """R, the pool's rank, of a pool buffer of ``U`` ranks a page (4-dim: paged, C pages; else one page)."""
    return U * (w.shape[1] if w.dim() == 4 else 1)


def _layout_ok(A: torch.Tensor, B: torch.Tensor) -> bool:
    """Whether the kernels read these pool buffers in place: A's rows and each of B's columns (its U
    ranks) contiguous, B's columns one after another."""
    return A.stride(-1) == 1 and B.stride(-1) == 1 and B.stride(-2) == B.shape[-1]


def lora_row_shrink(
    x: torch.Tensor, A: torch.Tensor, n_slices: int, token_slots: torch.Tensor, ranks: torch.Tensor
) -> torch.Tensor:
    """``h[t, i*R + j] = x[t] @ A[slot(t), slice i, rank j]`` for ``j < ranks[slot(t)]``, zeros for the
    other ranks and for rows without an adapter (slot -1 or rank 0); each A row read in place.

    x [T, in] (unit column stride, any row stride); A [S, n*R, in] or paged by rank tile [S, C, n*U, in]
    (R = C*U; the pool's views: last dim contiguous, any other strides); x's dtype, one of :data:`ROW_DTYPES`.
    token_slots int32 [>= T] (slot(t), -1 base-only), ranks int32 [S] contiguous. Returns h [T, n*R] in
    x's dtype, each value summed in fp32 and rounded once. Needs :func:`available`.
    """
    if x.dim() != 2 or A.dim() not in (3, 4) or A.shape[-1] != x.shape[1] or A.shape[-2] % n_slices:
        raise ValueError(f"lora_row_shrink: x {tuple(x.shape)}, A {tuple(A.shape)}, {n_slices} slices")
    _check_routing("lora_row_shrink", x.shape[0], A.shape[0], token_slots, ranks)
    if x.dtype != A.dtype or x.dtype not in ROW_DTYPES:
        raise ValueError(f"lora_row_shrink: dtypes {x.dtype}, {A.dtype}")
    if x.stride(1) != 1 or A.stride(-1) != 1:
        raise ValueError("lora_row_shrink: needs x's columns and A's rows contiguous")
    if not available():
        raise RuntimeError("lora_row_shrink: the CPU kernels are off or could not be built here")
    return lora_row_shrink_unchecked(x, A, n_slices, token_slots, ranks)


def lora_row_shrink_unchecked(
    x: torch.Tensor, A: torch.Tensor, n_slices: int, token_slots: torch.Tensor, ranks: torch.Tensor
) -> torch.Tensor:
    """:func:`lora_row_shrink` without its checks."""
    U = A.shape[-2] // n_slices
    R = _pool_rank(A, U)
    a_slot, a_page, lda = _pool_strides(A)
    T = x.shape[0]
    h = torch.empty(T, n_slices * R, dtype=x.dtype)
    lib = _library()
    fn = lib.lora_row_shrink_f32 if x.dtype == torch.float32 else lib.lora_row_shrink_bf16
    fn(T, x.data_ptr(), x.stride(0), h.data_ptr(), h.stride(0), A.data_ptr(), a_slot, a_page, lda, x.shape[1],
       n_slices, U, R, token_slots.data_ptr(), ranks.data_ptr(), torch.get_num_threads())  # fmt: skip
    return h


def lora_row_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    B: torch.Tensor,
    scalings: torch.Tensor,
    slice_offsets: tuple[int, ...],
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
) -> None:
    """``y[t, lo_i:hi_i] += scalings[s, i] * h[t, i*R : i*R + r] @ B[s, lo_i:hi_i, :r].T`` for every row t
    with an adapter (s = slot(t), r = ranks[s]), slice i of ``slice_offsets``; other rows untouched. The
    delta is summed in fp32 and (bf16) rounded before it is added; each B value read in place.

    y [T, out], h [T, n*R] (:func:`lora_row_shrink`'s; unit column strides); B [S, out, R] or paged [S, C,
    out, U] (last two dims contiguous), y's dtype (one of :data:`ROW_DTYPES`); scalings fp32 [S, n] (unit
    column stride); token_slots, ranks as for :func:`lora_row_shrink`. Needs :func:`available`.
    """
    n = len(slice_offsets) - 1
    U = B.shape[-1]
    R = _pool_rank(B, U)
    T = y.shape[0]
    if h.shape != (T, n * R) or B.dim() not in (3, 4) or slice_offsets[-1] > min(y.shape[1], B.shape[-2]):
        raise ValueError(
            f"lora_row_expand: y {tuple(y.shape)}, h {tuple(h.shape)}, B {tuple(B.shape)}, {slice_offsets}"
        )
    if scalings.shape != (B.shape[0], n) or scalings.dtype != torch.float32 or scalings.stride(1) != 1:
        raise ValueError(f"lora_row_expand: scalings {tuple(scalings.shape)} {scalings.dtype}")
    _check_routing("lora_row_expand", T, B.shape[0], token_slots, ranks)
    if not (y.dtype == h.dtype == B.dtype) or y.dtype not in ROW_DTYPES:
        raise ValueError(f"lora_row_expand: dtypes {y.dtype}, {h.dtype}, {B.dtype}")
    if y.stride(1) != 1 or h.stride(1) != 1 or B.stride(-1) != 1 or B.stride(-2) != U:
        raise ValueError("lora_row_expand: needs unit column strides in y and h, B's columns contiguous")
    if not available():
        raise RuntimeError("lora_row_expand: the CPU kernels are off or could not be built here")
    lora_row_expand_unchecked(y, h, B, scalings, slice_offsets, token_slots, ranks)


def lora_row_expand_unchecked(
    y: torch.Tensor,
    h: torch.Tensor,
    B: torch.Tensor,
    scalings: torch.Tensor,
    slice_offsets: tuple[int, ...],
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
) -> None:
    """:func:`lora_row_expand` without its checks."""
    U = B.shape[-1]
    b_slot, b_page, _ = _pool_strides(B)
    lib = _library()
    fn = lib.lora_row_expand_f32 if y.dtype == torch.float32 else lib.lora_row_expand_bf16
    offs = _offsets(tuple(slice_offsets))
    fn(y.shape[0], h.data_ptr(), h.stride(0), y.data_ptr(), y.stride(0), B.data_ptr(), b_slot, b_page, U,
       _pool_rank(B, U), len(slice_offsets) - 1, ctypes.addressof(offs), scalings.data_ptr(),
       scalings.stride(0), token_slots.data_ptr(), ranks.data_ptr(), torch.get_num_threads())  # fmt: skip


@functools.cache
def _offsets(slice_offsets: tuple[int, ...]) -> ctypes.Array:
    """The slice offsets as a C int64 array that lives as long as the process: a plan keeps its address
    (a tensor made here inside a capture would be refused as Python data)."""
    return (ctypes.c_int64 * len(slice_offsets))(*slice_offsets)


def _check_routing(name: str, T: int, S: int, token_slots: torch.Tensor, ranks: torch.Tensor) -> None:
    if token_slots.dtype != torch.int32 or token_slots.dim() != 1 or token_slots.shape[0] < T:
        raise ValueError(
            f"{name}: token_slots int32 [>= {T}], got {token_slots.dtype} {tuple(token_slots.shape)}"
        )
    if (
        ranks.dtype != torch.int32
        or ranks.shape != (S,)
        or not (ranks.is_contiguous() and token_slots.is_contiguous())
    ):
        raise ValueError(f"{name}: ranks int32 [{S}] contiguous, got {ranks.dtype} {tuple(ranks.shape)}")


def takes(out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights) -> bool:
    """Whether :func:`add_lora_rows` runs this module's LoRA: the kernels built and on (:data:`ENABLED`), x
    and out [T, *] on the CPU with unit column strides, one dtype of :data:`ROW_DTYPES` with the pool, the
    pool's buffers laid out as the kernels read them."""
    return (
        ENABLED
        and x.device.type == "cpu"
        and x.dim() == 2
        and out.dim() == 2
        and x.dtype == out.dtype == weights.A.dtype == weights.B.dtype
        and x.dtype in ROW_DTYPES
        and x.stride(1) == 1
        and out.stride(1) == 1
        and weights.scalings.stride(1) == 1
        and _layout_ok(weights.A, weights.B)
        and available()
    )


def add_lora_rows(out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> None:
    """``out[:T] += lora(x[:T])``, every row on its own slot (``info.token_slots``), for a module
    :func:`takes`: the shrink into a new h, then the expand into ``out``. Reads only tensors whose
    addresses stay fixed and host ints a decode plan fixes, so a plan records it."""
    T, n = info.num_tokens, weights.n_slices
    h = lora_row_shrink_unchecked(x[:T], weights.A, n, info.token_slots, info.ranks)
    lora_row_expand_unchecked(
        out[:T], h, weights.B, weights.scalings, weights.slice_offsets, info.token_slots, info.ranks
    )
