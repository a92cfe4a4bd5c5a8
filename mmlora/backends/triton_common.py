"""Shared pieces of the Triton LoRA backends: launch heuristics, the validated entry, jitted helpers
(the argument checks are in :mod:`mmlora.backends.triton_checks`).

Both backends follow :mod:`mmlora.backends.base`. Slice offsets of packed modules reach the kernels as
scalar arguments (``o0 .. o4``, padded past ``n_slices`` with the last offset), so launches allocate
nothing and need no device copy of the offsets: this keeps them capturable in CUDA graphs.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mmlora.backends.base import LoRABackend
from mmlora.backends.triton_checks import (
    KERNELS_INTERPRETED,
    MAX_SLICES,
    CheckedWeights,
    check_expand_weights,
    check_shrink_args,
)
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether kernels cast ``tl.dot`` operands to fp32 first.

    The interpreter's bf16 dot returns garbage (seen with triton 3.9), so under the interpreter every
    dot runs in fp32; on a GPU fp16/bf16 operands go to the tensor cores as they are.
    """
    return KERNELS_INTERPRETED or dtype == torch.float32


@functools.lru_cache(maxsize=16)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_launch(device: torch.device, wanted: bool) -> bool:
    """Whether an expand is launched as a programmatic dependent of its shrink (PDL, ``launch_pdl``): on
    Hopper and newer, outside the interpreter, where the backend's TUNING asks for it. The expand then
    starts while the shrink runs: it loads its B tiles and the output rows, and waits
    (``gdc_wait``) only before it reads the shrink's partials; the shrink lets it start at once
    (``gdc_launch_dependents``). Kernels launched without the attribute behave as before (the wait
    returns at once)."""
    return (
        wanted
        and device.type == "cuda"
        and not KERNELS_INTERPRETED
        and _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9
    )


def pdl_options(pdl: bool) -> dict:
    """An expand's PDL constexpr and, when on, the launch option that makes it a dependent launch."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


@functools.lru_cache(maxsize=16)
def _sm_count(device_type: str, index: int | None) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index or 0).multi_processor_count
    return 4  # the interpreter: a small number keeps split-K exercised at tiny shapes


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (host-side, cached; 4 for CPU/interpreter)."""
    return _sm_count(device.type, device.index)


# Host-side launch arithmetic. Since Triton 3.5, ``triton.cdiv`` and ``triton.next_power_of_2`` are
# constexpr functions whose host calls go through a wrapper (4.6 and 5.6 us a call against 0.2 us for
# the plain expression, triton 3.9 on the shared 2-core CPU); an eager Mistral-7B forward made about
# 1,000 of them. Equal to Triton's for every int ``a`` and ``b > 0``, and for ``n >= 1``.
def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def split_k_plan(
    in_features: int,
    block_k: int,
    busy: int,
    device: torch.device,
    forced: int | None,
    tuning: dict,
    least: int = 1,
) -> tuple[int, int]:
    """(k_per_split, splits) of a shrink's split of in_features into whole ``block_k`` blocks:
    ``forced`` splits, else enough for ``tuning["waves"]`` waves of programs on the device's SMs when one
    split keeps ``busy`` programs busy, and at least ``least``; at most ``tuning["max_split_k"]`` (every
    split non-empty)."""
    k_blocks = cdiv(in_features, block_k)
    want = forced or max(least, cdiv(tuning["waves"] * sm_count(device), busy))
    split = max(1, min(want, tuning["max_split_k"], k_blocks))
    k_per_split = cdiv(k_blocks, split) * block_k
    return k_per_split, cdiv(in_features, k_per_split)


class ShrinkJob(NamedTuple):
    """A validated shrink, what each backend's launcher takes: ``h[t] = x[t] @ A[slot of t].T`` with A
    [slots, n*R, K] holding ``n`` slices of pool rank ``R``. ``skip_pad``: programs stop at each slice's
    rank (A's rows are n slices); ``split_k``: a forced split of K (None: the launcher's heuristic)."""

    x: torch.Tensor
    A: torch.Tensor
    info: LoRABatchInfo
    n: int
    R: int
    skip_pad: bool
    split_k: int | None

    @property
    def top_rank(self) -> int:
        """The rank launch shapes cover: the batch's rank bound with ``skip_pad``, else the pool's."""
        return min(self.info.rank_bound, self.R) if self.skip_pad else self.R


def shrink_entry(
    launch: Callable[[ShrinkJob], torch.Tensor],
    x: torch.Tensor,
    A: torch.Tensor,
    info: LoRABatchInfo,
    n_slices: int | None,
    split_k: int | None,
) -> torch.Tensor:
    """A backend's public shrink: checks, zeros when nothing is computed, else ``launch``'s planes
    ``[splits, T, n*R]`` summed to x.dtype."""
    n, R = check_shrink_args(x, A, info, n_slices)
    if not info.has_lora or info.num_tokens == 0:
        return x.new_zeros(info.num_tokens, n * R)
    planes = launch(ShrinkJob(x, A, info, n, R, n_slices is not None, split_k))
    return planes[0].to(x.dtype) if planes.shape[0] == 1 else planes.sum(0).to(x.dtype)


def offset_args(slice_offsets: tuple[int, ...]) -> tuple[int, ...]:
    """``slice_offsets`` padded to ``MAX_SLICES + 1`` scalars (repeating the last) for the kernels."""
    offs = tuple(int(o) for o in slice_offsets)
    return offs + (offs[-1],) * (MAX_SLICES + 1 - len(offs))


class FusedTritonBackend(LoRABackend):
    """What the Triton backends share: ``add_lora`` validates, then shrink's fp32 split-K partial
    planes go straight to expand (two launches, no reduction pass); each backend supplies ``_fused``.
    ``split_k`` (None: the backend's heuristic) fixes shrink's split of in_features.

    Validation is host time on every eager forward (about 34 us a call on a loaded 2-core CPU, 128 calls
    a Mistral-7B forward), so a module's weights are checked in full once and later calls only compare
    ``x``, ``out`` and the batch with what that check found; anything unexpected takes the full check
    again, which raises with its specific message."""

    split_k: int | None = None
    _MAX_CHECKED = 4096  # modules remembered (a model has a few hundred; tests make many)

    def __init__(self) -> None:
        self._checked: dict[int, CheckedWeights] = {}  # id(weights) -> what its full check found

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> None:
        self._checked_launch(self._fused, out, x, weights, info)

    def add_lora_after_base(
        self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo
    ) -> None:
        self._checked_launch(self._fused_after_base, out, x, weights, info)

    def _checked_launch(
        self,
        launch: Callable[..., None],
        out: torch.Tensor,
        x: torch.Tensor,
        weights: LoRAWeights,
        info: LoRABatchInfo,
    ) -> None:
        """``launch(out, x, weights, info, R)`` after the call's checks, where there is anything to do."""
        if not info.has_lora:
            return
        R = self._validated_rank(out, x, weights, info)
        if info.num_tokens == 0:
            return
        launch(out, x, weights, info, R)

    def _fused_after_base(
        self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, R: int
    ) -> None:
        """``_fused`` right after the kernel that wrote ``out`` (see ``add_lora_after_base``)."""
        self._fused(out, x, weights, info, R)

    def _validated_rank(
        self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo
    ) -> int:
        """The pool rank R, after the full check of this call (or the remembered one it matches)."""
        checked = self._checked
        seen = checked.get(id(weights))
        if seen is not None and seen.weights is weights and seen.accepts(out, x, info):
            return seen.rank
        n, R = check_shrink_args(x, weights.A, info, weights.n_slices)
        check_expand_weights(n * R, x.dtype, weights, info, out)
        if len(checked) >= self._MAX_CHECKED:
            checked.clear()
        checked[id(weights)] = CheckedWeights(weights, R)
        return R

    def start_lora(
        self, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo
    ) -> Callable[[torch.Tensor], None]:
        """The shrink now (its inputs validated), the expand when the returned function gets ``out``
        (which is validated then, as ``add_lora`` does); backends without a split run it all then."""
        if self._shrink_phase is None or not info.has_lora or info.num_tokens == 0:
            return super().start_lora(x, weights, info)
        R = self._input_rank(x, weights, info)
        partials = self._shrink_phase(x, weights, info, R)

        def finish(out: torch.Tensor) -> None:
            self._validated_rank(out, x, weights, info)  # out is checked here, as add_lora checks it
            self._expand_phase(out, partials, weights, info, R, x.dtype)

        return finish

    def _input_rank(self, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> int:
        """The pool rank R, after checking the shrink's inputs (or matching a remembered full check)."""
        seen = self._checked.get(id(weights))
        if seen is not None and seen.weights is weights and seen.accepts_input(x, info):
            return seen.rank
        return check_shrink_args(x, weights.A, info, weights.n_slices)[1]

    def splits_work(self, info: LoRABatchInfo) -> bool:
        return self._shrink_phase is not None

    #: Backends that split their work define ``_shrink_phase(x, weights, info, R) -> partials`` and
    #: ``_expand_phase(out, partials, weights, info, R, x_dtype)``: start_lora's two phases.
    _shrink_phase = None
    _expand_phase = None

    @abstractmethod
    def _fused(
        self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, R: int
    ) -> None:
        """``out += lora(x)`` on validated inputs, the pool rank being ``R``."""


def a_page_args(A: torch.Tensor, n_slices: int) -> tuple[int, int, int, int]:
    """A pool's A as the kernels take it: (slot stride, page stride, row stride, U), U the ranks per page,
    0 for the unpaged layout (whose kernels' code is unchanged: :func:`a_row_offset`)."""
    if A.dim() == 3:
        return A.stride(0), 0, A.stride(1), 0
    return A.stride(0), A.stride(1), A.stride(2), A.shape[2] // n_slices


def b_page_args(B: torch.Tensor) -> tuple[int, int, int, int]:
    """A pool's B as the kernels take it: (slot stride, page stride, output-row stride, U; 0 unpaged)."""
    if B.dim() == 3:
        return B.stride(0), 0, B.stride(1), 0
    return B.stride(0), B.stride(1), B.stride(2), B.shape[3]


def rank_bucket_bound(info: LoRABatchInfo, R: int) -> int:
    """The batch's rank bucket (``info.rank_bound``), at most the pool rank R; R for a batch without
    adapter rows. Launch tiles sized by it are those of a pool of that rank."""
    return min(R, info.rank_bound) if info.rank_bound > 0 else R


@triton.jit
def gated_act(g, u, ACT, dtype: tl.constexpr):
    """``round(round(act(g)) * u)`` in ``dtype`` from fp32 ``g`` and ``u``: act SiLU (ACT 0) or
    tanh-approximated GELU (ACT 1; constexpr or a runtime int), in fp32. act(g) is rounded to the dtype
    before the product, as torch's ``act(gate) * up`` rounds."""
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    else:
        # 0.5 * (1 + tanh(z)) = sigmoid(2z): no tanh needed, and no cancellation near 0.
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-2.0 * z))
    return (a.to(dtype).to(tl.float32) * u).to(dtype)


@triton.jit
def a_row_offset(j, r, R, U: tl.constexpr, stride_page, stride_row):
    """Element offset, within a slot, of A's row for rank ``r`` of slice ``j``: row ``j * R + r`` of an
    unpaged pool (U = 0), or in a pool paged by rank tile (:class:`LoRAWeights`) row ``j * U + r % U`` of
    page ``r // U``."""
    if U == 0:
        return (j * R + r) * stride_row
    return (r // U) * stride_page + (j * U + r % U) * stride_row


@triton.jit
def b_rank_offset(r, U: tl.constexpr, stride_page):
    """Element offset, within a B row of a slot, of rank ``r``: ``r`` unpaged (U = 0), else in page ``r // U``."""
    if U == 0:
        return r
    return (r // U) * stride_page + r % U


@triton.jit
def rank_load_bound(rank, R):
    """How far a slot's rank-indexed loads may go: its rank rounded up to 16, at most the pool rank R.

    A mask ``k < rank`` (a loaded value) is known to hold for single elements only, so Triton loads them
    one at a time; against this bound (a multiple of 16, or R, whose divisibility Triton is told) it
    knows the mask is constant over 16 (or R's divisibility) neighbours and loads them as vectors. The
    columns between the rank and the bound (padding, possibly NaN) must then be dropped with a where.
    H200 (``benchmarks/results/h200-2026-12-03-session16``, two rounds): the SGMV cases of the decode
    anatomy 0.75-0.95x as long (rank-64 decode runs 208 -> 156 us), BGMV unchanged or 0.92-0.97x.
    """
    return tl.minimum(tl.cdiv(rank, 16) * 16, R)


@triton.jit
def slice_bound(i: tl.constexpr, o0, o1, o2, o3, o4):
    """The ``i``-th slice offset among the scalar offsets (``i`` known at compile time)."""
    if i == 0:  # noqa: SIM116  (no dicts in jitted code)
        return o0
    elif i == 1:
        return o1
    elif i == 2:
        return o2
    elif i == 3:
        return o3
    else:
        return o4


@triton.jit
def select_bound(s, o0, o1, o2, o3, o4):
    """The ``s``-th slice offset for a run-time scalar ``s`` in [0, MAX_SLICES]."""
    return tl.where(s == 0, o0, tl.where(s == 1, o1, tl.where(s == 2, o2, tl.where(s == 3, o3, o4))))
