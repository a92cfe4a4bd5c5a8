"""torch-gather: the reference backend in plain PyTorch, right for any mix of ranks and base-only rows.

Decode-like batches (one token per segment) gather each token's A/B by slot and use one batched
matmul; prefill-like batches loop over the (few) segments with one dense matmul each, which avoids
materialising a [tokens, R, in] gather. Runs on CPU and GPU.

On CPU, a batch of at most :data:`~mmlora.backends.onednn.PACKED_MAX_ROWS` tokens over few slots (a
decode step, a short chunk) takes a dense path (:mod:`mmlora.backends.cpu_dense`): every slot's shrink
in one matmul, the other slots' columns masked to zeros, and the expand as one more matmul, through
oneDNN-prepacked copies where :mod:`mmlora.backends.onednn` says packing pays. The LoRA layer tries
:meth:`TorchGatherBackend.fused_linear` first, where the shrink rides on the base GEMM. CPU batches
over more slots than the dense path takes (or a paged pool) with few rows per adapter (decode steps, and
every step of a CPU decode plan) run the per-row C kernels where built
(:mod:`mmlora.backends.cpu_row_lora`: each row reads its own slot's A and B in place, routed by tensors, so
a plan records them). Other larger CPU batches whose adapter segments outnumber their slots (prefills of
many prompts on few adapters) group tokens by slot (from the host mirrors, no sync to pay) and run one
dense matmul per distinct adapter: the per-token gather copies every token's A and B, which on CPU costs
more than the matmuls themselves. On GPU the gather path stays, as it reads only device tensors and so is
capturable in CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from mmlora.backends import cpu_row_lora
from mmlora.backends.base import LoRABackend
from mmlora.backends.cpu_dense import ShrinkFused, live_weights, slot_mask
from mmlora.backends.onednn import (
    PACKED_MAX_ROWS,
    pack_weight,
    packable_dtypes,
    packed_matmul,
    packed_matmul_available,
    packed_matmul_rows,
)
from mmlora.backends.registry import register_backend
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights, unpage_a, unpage_b


def _per_token(info: LoRABatchInfo) -> bool:
    return info.num_segments == info.num_tokens


def _by_slot(x: torch.Tensor, info: LoRABatchInfo) -> bool:
    """Whether a CPU batch runs one matmul per adapter slot over its rows gathered (:func:`_slot_groups`)
    rather than one per segment: where its adapter segments outnumber their slots (a decode-like batch,
    or a prefill of many prompts on few adapters: 16 prompts on 4 adapters make 4 gathers instead of 16
    segment matmuls per slice, each a torch call that costs more than its FLOPs at these sizes)."""
    if x.device.type != "cpu":
        return False
    route = info.host_derived
    if "by-slot" not in route:
        slots = [s for s in info.seg_slots_host if s >= 0]
        route["by-slot"] = _per_token(info) or len(slots) > len(set(slots))
    return route["by-slot"]


def _by_row(x: torch.Tensor, info: LoRABatchInfo) -> bool:
    """Whether a CPU batch over more slots than the dense path takes runs the per-row C kernels
    (:mod:`~mmlora.backends.cpu_row_lora`, where built) rather than :func:`_slot_groups`' matmul per slot:
    every step of a CPU decode plan (``info.graph_layout`` set: the per-slot path makes index tensors from
    Python lists, which a plan cannot replay), and eager batches of at most :data:`_ROW_MAX_SHARE` adapter
    rows per distinct slot on average (past that, one matmul per slot reads A and B as few times and runs
    at BLAS speed)."""
    if x.device.type != "cpu":
        return False
    route = info.host_derived
    if "by-row" not in route:
        rows = sum(n for n, s in zip(info.seg_lens_host, info.seg_slots_host) if s >= 0)
        slots = len({s for s in info.seg_slots_host if s >= 0})
        route["by-row"] = info.graph_layout is not None or rows <= _ROW_MAX_SHARE * slots
    return route["by-row"]


def gather_shrink(x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
    """x [T, in], A [S, n*R, in] -> h [T, n*R] in x.dtype: ``h[t] = x[t] @ A[slot(t)].T``, zero rows for
    base-only tokens."""
    T = info.num_tokens
    if _by_slot(x, info):
        h = x.new_zeros(T, A.shape[1])
        for slot, idx in _slot_groups(info):
            h.index_copy_(0, idx, x.index_select(0, idx) @ A[slot].T)
        return h
    if _per_token(info):
        slots = info.token_slots[:T].long()
        mask = slots >= 0
        a = A[slots.clamp(min=0)]  # [T, nR, in]
        h = torch.bmm(a, x[:T].unsqueeze(-1)).squeeze(-1)
        return h * mask.unsqueeze(-1).to(h.dtype)
    h = x.new_zeros(T, A.shape[1])
    start = 0
    for n, slot in zip(info.seg_lens_host, info.seg_slots_host):
        if slot >= 0:
            h[start : start + n] = x[start : start + n] @ A[slot].T
        start += n
    return h


def gather_expand(h: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, out: torch.Tensor) -> None:
    """h [T, n*R] -> ``out[t, slice i] += h[t, slice i] @ B[slot(t), slice i].T * scalings[slot(t), i]``
    for every token with an adapter."""
    B, scalings, offs = weights.B, weights.scalings, weights.slice_offsets
    T = info.num_tokens
    R = B.shape[2]
    n_slices = weights.n_slices
    if _by_slot(h, info):
        for slot, idx in _slot_groups(info):
            hs = h.index_select(0, idx)
            parts = [
                (hs[:, i * R : (i + 1) * R] @ B[slot, offs[i] : offs[i + 1]].T)
                * scalings[slot, i].to(h.dtype)
                for i in range(n_slices)
            ]
            delta = parts[0] if n_slices == 1 else torch.cat(parts, dim=1)
            out[:, offs[0] : offs[-1]].index_add_(0, idx, delta.to(out.dtype))
        return
    if _per_token(info):
        slots = info.token_slots[:T].long()
        mask = (slots >= 0).unsqueeze(-1)
        idx = slots.clamp(min=0)
        b = B[idx]  # [T, out, R]
        scale = scalings[idx]  # [T, n]
        for i in range(n_slices):
            lo, hi = offs[i], offs[i + 1]
            hi_ = h[:, i * R : (i + 1) * R].unsqueeze(-1)
            delta = torch.bmm(b[:, lo:hi], hi_).squeeze(-1) * scale[:, i : i + 1].to(h.dtype)
            out[:T, lo:hi] += (delta * mask).to(out.dtype)
        return
    start = 0
    for n, slot in zip(info.seg_lens_host, info.seg_slots_host):
        if slot >= 0:
            rows = slice(start, start + n)
            for i in range(n_slices):
                lo, hi = offs[i], offs[i + 1]
                delta = h[rows, i * R : (i + 1) * R] @ B[slot, lo:hi].T
                out[rows, lo:hi] += (delta * scalings[slot, i].to(h.dtype)).to(out.dtype)
        start += n


@register_backend("torch-gather")
class TorchGatherBackend(LoRABackend):
    def __init__(self) -> None:
        self._dense_cache: dict[int, _DenseWeights] = {}
        self._fused_cache: dict[int, ShrinkFused] = {}

    @staticmethod
    def _unpaged(weights: LoRAWeights, info: LoRABatchInfo) -> LoRAWeights:
        """A paged pool's ``weights`` copied to the unpaged layout, per call (pool buffers made under
        inference mode have no version counter to tell a slot load by), with every rank past each slot's
        own zeroed: a slot's view runs on into the pages of the adapters after it, and this backend
        multiplies the padding. The paged layout is for the Triton kernels; this reference backend pays a
        copy for kernels written for one layout."""
        n, R = weights.n_slices, weights.rank
        live = torch.arange(R, device=info.ranks.device)[None, :] < info.ranks[:, None]  # [slots, R]
        A = torch.where(live[:, None, :, None], unpage_a(weights.A, n).view(-1, n, R, weights.A.shape[-1]), 0)
        B = torch.where(live[:, None, :], unpage_b(weights.B), 0)
        return LoRAWeights(A.view(-1, n * R, A.shape[-1]), B, weights.scalings, weights.slice_offsets)

    def fused_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        weights: LoRAWeights,
        info: LoRABatchInfo | None,
    ) -> torch.Tensor | None:
        """x [T, in] on CPU (a packable dtype, no autograd recording): ``x @ W.T + bias`` plus the batch's
        LoRA delta, the base GEMM and every slot's shrink as one packed matmul over the module's stacked
        ``[W; A_live]`` (:class:`~mmlora.backends.cpu_dense.ShrinkFused`); returns [T, out] (a view of
        [T, out + K]: the last K columns are the shrink). Then ``h = shrink * mask`` (each row's own
        slot) and one more matmul adds ``h @ expand``. A batch without adapter rows (``info`` None or
        no LoRA) gets the base columns only, so the layer can free the base's own packed copy.

        Where the C kernels are built (:mod:`~mmlora.backends.cpu_kernels`), the mask, the expand and
        the add are one call at any row count instead (:meth:`~mmlora.backends.cpu_dense.ShrinkFused.add_expand`).
        Past PACKED_MAX_ROWS tokens (prefill) the matmuls run as PackedLinear runs them
        (:func:`~mmlora.backends.onednn.packed_matmul_rows`); the expand stays dense only where the adapter segments outnumber their
        slots and the live rank rows are at most 1 / _PREFILL_RANK_SHARE of the input width (every row
        multiplies every slot's rank rows), else the segment or per-slot path adds the delta.

        None where it does not fuse (the layer then runs the base and :meth:`add_lora`): not CPU, a
        dtype oneDNN does not pay in, dtypes that differ, autograd recording x or the weight, an
        inference-mode weight (no version counter to notice a reload by), or live rank rows past
        :data:`~mmlora.backends.cpu_dense.STACK_SHARE` of the output width."""
        if (
            x.device.type != "cpu"
            or weights.pages > 1  # a paged pool takes add_lora's unpaged copy
            or x.dim() != 2
            or x.dtype not in _packable()
            or not x.dtype == weight.dtype == weights.A.dtype == weights.B.dtype
            or weight.is_inference()
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            return None
        stacked = self._stacked(weight, bias, weights, info)
        if stacked is None:
            return None
        T, out = x.shape[0], stacked.out_features
        yk = packed_matmul_rows(x, stacked.WA, stacked.bias)
        y = yk[:, :out]
        if info is None or not info.has_lora or stacked.add_expand(yk, info, weights.n_slices):
            return y
        if T <= PACKED_MAX_ROWS or (
            _by_slot(x, info) and stacked.live_rows * _PREFILL_RANK_SHARE <= x.shape[1]
        ):
            h = yk[:, out:] * slot_mask(info, weights.n_slices, x.dtype)
            y += packed_matmul_rows(h, stacked.packed_expand())
        else:
            gather_expand(gather_shrink(x, weights.A, info), weights, info, y)
        return y

    def _stacked(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        weights: LoRAWeights,
        info: LoRABatchInfo | None,
    ) -> ShrinkFused | None:
        """The module's stacked weights, cached on B's data pointer and rebuilt when a slot load writes
        A, B or the scalings, a slot's rank changes, or the base weight or bias is written (version
        counters). Without ``info`` (a forward outside the LoRA manager) the cached ones, if any."""
        cached = self._fused_cache.get(weights.B.data_ptr())
        if info is None:
            ranks = list(cached.key[-1]) if cached is not None else None
            if ranks is None:
                return None
        else:
            ranks = info.ranks_host
        key = ShrinkFused.key_of(weight, bias, weights, ranks)
        if cached is not None and cached.matches(weight, bias, weights, key):
            return cached
        stacked = ShrinkFused.build(weight, bias, weights, ranks, key)
        if stacked is None:
            self._fused_cache.pop(weights.B.data_ptr(), None)
        else:
            self._fused_cache[weights.B.data_ptr()] = stacked
        return stacked

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> None:
        """Shrink then expand; small CPU batches over few slots (decode steps, short chunks) take a dense
        path instead: two matmuls over every slot's live rank rows, with the rows of other slots masked to
        exact zeros. At small batches the cost is per torch call, not per FLOP, and this keeps the call
        count independent of the adapters and of how the rows group into segments. Past the dense path's
        slots (or on a paged pool), CPU batches of few rows per adapter (:func:`_by_row`) run two C calls
        that read each row's own slot in place (:func:`~mmlora.backends.cpu_row_lora.add_lora_rows`)."""
        if not info.has_lora:
            return
        T = info.num_tokens
        few_slots = x.device.type == "cpu" and T <= PACKED_MAX_ROWS and info.num_slots <= _DENSE_MAX_SLOTS
        if (not few_slots or weights.pages > 1) and _by_row(x, info) and cpu_row_lora.takes(out, x, weights):
            cpu_row_lora.add_lora_rows(out, x, weights, info)
            return
        if weights.pages > 1:  # per-call copies: the cached dense path would hold stale ones
            weights = self._unpaged(weights, info)
            gather_expand(gather_shrink(x, weights.A, info), weights, info, out)
            return
        if not few_slots:
            gather_expand(gather_shrink(x, weights.A, info), weights, info, out)
            return
        dense = self._dense(weights, info.ranks_host, packed=x.dtype in _packable())
        mask = slot_mask(info, weights.n_slices, x.dtype)
        lo, hi = weights.slice_offsets[0], weights.slice_offsets[-1]
        if dense.packed:
            # oneDNN's blocked copies (as PackedLinear has for the base weights): a plain mm re-blocks its
            # weight on every call, which at decode sizes costs more than the multiply (SmolLM2, 16 rows,
            # the 120 LoRA modules of a step: 9.7 -> 6.8 ms).
            h = packed_matmul(x[:T], dense.A)  # [T, live rows]: every slot's shrink
            h *= mask
            out[:T, lo:hi] += packed_matmul(h, dense.W)
            return
        h = x[:T] @ dense.A.T.to(x.dtype)
        h *= mask
        out[:T, lo:hi].addmm_(h, dense.W.to(out.dtype))

    def _dense(self, weights: LoRAWeights, ranks: list[int], packed: bool) -> _DenseWeights:
        """The module's dense-path weights over its slots' live rank rows (a rank-8 adapter in a rank-64
        pool costs 8 rows, not 64), cached; rebuilt only when the pool writes into A, B or the scalings
        (their version counters move with every in-place change, as a slot load makes) or a slot's rank
        changes."""
        A, B, scalings = weights.A, weights.B, weights.scalings
        key = (A._version, B._version, scalings._version, tuple(ranks), packed)
        cached = self._dense_cache.get(B.data_ptr())
        if cached is not None and cached.B is B and cached.key == key:
            return cached
        A_live, W_live = live_weights(weights, ranks)
        if packed:
            dense = _DenseWeights(B, key, True, pack_weight(A_live), pack_weight(W_live.T.contiguous()))
        else:
            dense = _DenseWeights(B, key, False, A_live, W_live)
        self._dense_cache[B.data_ptr()] = dense
        return dense


@dataclasses.dataclass
class _DenseWeights:
    B: torch.Tensor  # the module's B view, to tell a reused data pointer from the cached module
    key: tuple  # A's, B's and the scalings' version counters, the slot ranks and packing when built
    packed: bool
    A: torch.Tensor  # the live rows of A [K, in] (packed by pack_weight, for packed_matmul)
    W: torch.Tensor  # the expand matrix's live rows [K, out] (packed: its transpose, for packed_matmul)


@functools.cache
def _packable() -> tuple[torch.dtype, ...]:
    return tuple(d for d in packable_dtypes() if packed_matmul_available(d))


_DENSE_MAX_SLOTS = 8
#: An eager CPU batch over many slots runs per row (:func:`_by_row`) up to this many adapter rows per distinct
#: slot on average: at 64 the kernels still ran ahead of a matmul per slot (SmolLM2, 256 rows on 4 of 128
#: slots: fp32 qkv 404 against 1059 us, gate_up 739 against 1082; bf16 gate_up 1110 against 1430), at 128 the
#: matmuls won bf16 gate_up (256 rows on 2 slots: 940 against 1114 us).
_ROW_MAX_SHARE = 64
#: A prefill fuses a module only where its live rank rows (every slot's) are at most this share of its
#: input width (see :meth:`TorchGatherBackend.fused_linear`).
_PREFILL_RANK_SHARE = 4


def _slot_groups(info: LoRABatchInfo) -> list[tuple[int, torch.Tensor]]:
    """(slot, int64 row indices of all its segments' tokens) for every adapter slot of the batch."""
    route = info.host_derived
    if "groups" not in route:
        rows: dict[int, list[int]] = {}
        start = 0
        for n, slot in zip(info.seg_lens_host, info.seg_slots_host):
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(start, start + n))
            start += n
        route["groups"] = [
            (slot, torch.tensor(r, dtype=torch.long, device=info.device)) for slot, r in rows.items()
        ]
    return route["groups"]
