"""Argument checks of the Triton LoRA backends: clear errors for what the kernels cannot take (shapes,
dtypes, devices, ranks past the pool's, a CPU without Triton's interpreter), and ``CheckedWeights``, the
memo that lets later calls on the same pool weights compare only the per-call half."""

from __future__ import annotations

import os

import torch

from mmlora.forward.lora import LoRABatchInfo, LoRAWeights

#: Packed modules in the supported models have at most 3 slices (q/k/v); 4 leaves room.
MAX_SLICES = 4
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: Triton decides at decoration time whether a kernel is interpreted, so what counts is the setting
#: when this module (and the kernel modules with it) was first imported.
KERNELS_INTERPRETED = interpreting()


def require_runnable(device: torch.device) -> None:
    """Refuse clearly (instead of Triton's "0 active drivers") to launch on CPU without the interpreter."""
    if device.type == "cpu" and not KERNELS_INTERPRETED:
        raise RuntimeError(
            "Triton LoRA backends on CPU need TRITON_INTERPRET=1 set before triton is first imported "
            "(e.g. `TRITON_INTERPRET=1 python ...`), or use lora_backend='torch-gather'"
        )


def _check_2d_rows(name: str, t: torch.Tensor, min_rows: int) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.shape[0] < min_rows:
        raise ValueError(f"{name} has {t.shape[0]} rows but the batch has {min_rows} tokens")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride()})")


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: float32, float16, bfloat16")


def _check_device(info: LoRABatchInfo, **tensors: torch.Tensor) -> None:
    where = info.seg_indptr.device  # the resolved device ("cuda:0"), unlike info.device ("cuda")
    for name, t in tensors.items():
        if t.device != where:
            raise ValueError(f"{name} is on {t.device} but the LoRABatchInfo is on {where}")


def check_shrink_args(
    x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo, n_slices: int | None
) -> tuple[int, int]:
    """Validate shrink inputs; returns ``(n_slices, R)`` (``(1, n*R)`` when ``n_slices`` is unknown)."""
    _check_2d_rows("x", x, info.num_tokens)
    _check_dtype("x", x)
    if A.dim() not in (3, 4):
        raise ValueError(
            "A must be 3-D [slots, n_slices * R, in_features] or paged 4-D [slots, pages, n_slices * U, "
            f"in_features], got shape {tuple(A.shape)}"
        )
    if A.dtype != x.dtype:
        raise ValueError(f"A has dtype {A.dtype} but x has {x.dtype}")
    if A.stride(-1) != 1:
        raise ValueError(f"A must be contiguous in its last dimension (stride {A.stride()})")
    if A.shape[-1] != x.shape[1]:
        raise ValueError(f"A has in_features {A.shape[-1]} but x has {x.shape[1]}")
    if A.shape[0] < info.num_slots:
        raise ValueError(f"A has {A.shape[0]} slots but the batch info addresses {info.num_slots}")
    _check_device(info, x=x, A=A)
    require_runnable(x.device)
    pages = A.shape[1] if A.dim() == 4 else 1
    rows = A.shape[-2]
    if n_slices is None:
        return 1, pages * rows
    if not 1 <= n_slices <= MAX_SLICES or rows % n_slices:
        raise ValueError(f"n_slices={n_slices} does not divide A's {rows} rows (max {MAX_SLICES})")
    R = pages * rows // n_slices
    if info.max_rank > R:
        raise ValueError(f"batch max_rank {info.max_rank} exceeds the pool's rank R={R}")
    return n_slices, R


def check_expand_args(
    h: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, out: torch.Tensor
) -> tuple[int, int]:
    """Validate expand inputs; returns ``(n_slices, R)``."""
    _check_2d_rows("h", h, info.num_tokens)
    _check_dtype("h", h)
    _check_device(info, h=h)
    return check_expand_weights(h.shape[1], h.dtype, weights, info, out)


def check_expand_weights(
    h_cols: int, h_dtype: torch.dtype, weights: LoRAWeights, info: LoRABatchInfo, out: torch.Tensor
) -> tuple[int, int]:
    """Validate expand's B, scalings, out and offsets against an ``h`` of ``h_cols`` columns of
    ``h_dtype``; returns ``(n_slices, R)``."""
    B, scalings, slice_offsets = weights.B, weights.scalings, weights.slice_offsets
    _check_2d_rows("out", out, info.num_tokens)
    _check_dtype("out", out)
    if B.dim() not in (3, 4):
        raise ValueError(
            "B must be 3-D [slots, out_features, R] or paged 4-D [slots, pages, out_features, U], got shape "
            f"{tuple(B.shape)}"
        )
    if B.dtype != h_dtype:
        raise ValueError(f"B has dtype {B.dtype} but h (x) has {h_dtype}")
    if B.stride(-1) != 1:
        raise ValueError(f"B must be contiguous in its last dimension (stride {B.stride()})")
    n = len(slice_offsets) - 1
    if not 1 <= n <= MAX_SLICES:
        raise ValueError(f"slice_offsets {slice_offsets} must describe 1..{MAX_SLICES} slices")
    if slice_offsets[0] != 0 or any(a > b for a, b in zip(slice_offsets, slice_offsets[1:])):
        raise ValueError(f"slice_offsets {slice_offsets} must start at 0 and be non-decreasing")
    out_features = B.shape[-2]
    if slice_offsets[-1] != out_features or out.shape[1] != out_features:
        raise ValueError(
            f"slice_offsets end {slice_offsets[-1]}, B out_features {out_features} and out width "
            f"{out.shape[1]} must agree"
        )
    if B.dim() != weights.A.dim() or (B.dim() == 4 and B.shape[1] != weights.A.shape[1]):
        raise ValueError(f"A {tuple(weights.A.shape)} and B {tuple(B.shape)} must have the same pages")
    R = (B.shape[1] if B.dim() == 4 else 1) * B.shape[-1]
    if h_cols != n * R:
        raise ValueError(f"h (A) has {h_cols} columns (rows) but n_slices * R = {n} * {R}")
    if B.shape[0] < info.num_slots:
        raise ValueError(f"B has {B.shape[0]} slots but the batch info addresses {info.num_slots}")
    if scalings.dtype != torch.float32 or scalings.dim() != 2 or scalings.shape[1] != n:
        raise ValueError(
            f"scalings must be float32 [slots, {n}], got {scalings.dtype} {tuple(scalings.shape)}"
        )
    if scalings.shape[0] < info.num_slots or scalings.stride(-1) != 1:
        raise ValueError(f"scalings must have >= {info.num_slots} slots and a contiguous last dimension")
    if info.max_rank > R:
        raise ValueError(f"batch max_rank {info.max_rank} exceeds the pool's rank R={R}")
    _check_device(info, B=B, scalings=scalings, out=out)
    require_runnable(out.device)
    return n, R


class CheckedWeights:
    """What a full check of one module's weights established, so that later calls on the same weights
    only compare ``x``, ``out`` and the batch against it (the pool's buffers never change shape)."""

    __slots__ = ("weights", "in_features", "out_features", "rank", "slots", "dtype", "device")

    def __init__(self, weights: LoRAWeights, rank: int) -> None:
        A, B, scalings = weights.A, weights.B, weights.scalings
        self.weights = weights  # held: its id() keys the cache and must not be reused while cached
        self.in_features = A.shape[-1]
        self.out_features = B.shape[-2]
        self.rank = rank
        self.slots = min(A.shape[0], B.shape[0], scalings.shape[0])
        self.dtype = A.dtype
        self.device = A.device

    def accepts(self, out: torch.Tensor, x: torch.Tensor, info: LoRABatchInfo) -> bool:
        """True only where check_shrink_args and check_expand_weights would pass (never less strict):
        the per-call half of their checks, the weights' half having passed once."""
        T = info.num_tokens
        return (
            self.accepts_input(x, info)
            and out.dim() == 2
            and out.shape[0] >= T
            and out.shape[1] == self.out_features
            and out.dtype in SUPPORTED_DTYPES
            and out.stride(-1) == 1
            and out.device == self.device
        )

    def accepts_input(self, x: torch.Tensor, info: LoRABatchInfo) -> bool:
        """The half of :meth:`accepts` that check_shrink_args covers (x and the batch)."""
        return (
            x.dim() == 2
            and x.shape[0] >= info.num_tokens
            and x.shape[1] == self.in_features
            and x.dtype == self.dtype
            and x.stride(-1) == 1
            and info.max_rank <= self.rank
            and info.num_slots <= self.slots
            and self.device == info.seg_indptr.device
            and x.device == self.device
        )
