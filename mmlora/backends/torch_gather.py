"""torch-gather: the reference backend in plain PyTorch, right for any mix of ranks and base-only rows.

Decode-like batches (one token per segment) gather each token's A/B by slot and use one batched
matmul; prefill-like batches loop over the (few) segments with one dense matmul each, which avoids
materialising a [tokens, R, in] gather. Runs on CPU and GPU.

On CPU, a batch of at most :data:`~mmlora.backends.onednn.PACKED_MAX_ROWS` tokens over few slots (a
decode step, a short chunk) takes a dense path: every slot's shrink in one matmul, the other slots' rows
masked to zeros, one expand, with oneDNN-prepacked copies of A and of the expand matrix where
:mod:`mmlora.backends.onednn` says packing pays. Larger CPU decode-like batches group tokens by slot
(from the host mirrors, no sync to pay) and run one dense matmul per distinct adapter: the per-token
gather copies every token's A and B, which on CPU costs more than the matmuls themselves. On GPU the
gather path stays, as it reads only device tensors and so is capturable in CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from mmlora.backends.base import LoRABackend
from mmlora.backends.onednn import (
    PACKED_MAX_ROWS,
    onednn_linear_available,
    pack_weight,
    packable_dtypes,
    packed_matmul,
)
from mmlora.backends.registry import register_backend
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights


def _per_token(info: LoRABatchInfo) -> bool:
    return info.num_segments == info.num_tokens


def gather_shrink(x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
    """x [T, in], A [S, n*R, in] -> h [T, n*R] in x.dtype: ``h[t] = x[t] @ A[slot(t)].T``, zero rows for
    base-only tokens."""
    T = info.num_tokens
    if _per_token(info) and x.device.type == "cpu":
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
    if _per_token(info) and h.device.type == "cpu":
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

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> None:
        """Shrink then expand; small CPU batches over few slots (decode steps, short chunks) take a dense
        path instead: two matmuls over every slot's live rank rows, with the rows of other slots masked to
        exact zeros. At small batches the cost is per torch call, not per FLOP, and this keeps the call
        count independent of the adapters and of how the rows group into segments."""
        if not info.has_lora:
            return
        T = info.num_tokens
        if x.device.type != "cpu" or T > PACKED_MAX_ROWS or info.num_slots > _DENSE_MAX_SLOTS:
            gather_expand(gather_shrink(x, weights.A, info), weights, info, out)
            return
        dense = self._dense(weights, info.ranks_host, packed=x.dtype in _packable())
        mask = _slot_mask(info, weights.n_slices, x.dtype)
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
        rows = _live_rows(weights.n_slices, A.shape[1] // weights.n_slices, ranks)
        A_live = A.reshape(-1, A.shape[2])[rows]  # [live rows, in]
        W_live = _expand_matrix(weights)[rows]  # [live rows, out]
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
    A: torch.Tensor  # the live rows of A [K, in] (packed: oneDNN's layout, for packed_matmul)
    W: torch.Tensor  # the expand matrix's live rows [K, out] (packed: its transpose, for packed_matmul)


def _live_rows(n_slices: int, R: int, ranks: list[int]) -> torch.Tensor:
    """Rows of the flattened [S * n * R] slot layout that hold rank (slot s, slice i: its first
    ``ranks[s]`` rows), slot-major; the rest is rank padding (zeros). :func:`_slot_mask` orders its
    columns the same way."""
    rows = [
        (s * n_slices + i) * R + j for s, r in enumerate(ranks) for i in range(n_slices) for j in range(r)
    ]
    return torch.tensor(rows, dtype=torch.long)


def _expand_matrix(weights: LoRAWeights) -> torch.Tensor:
    """[S * n * R, out]: row block (s, i) holds slot s's B for slice i (scaled), zero elsewhere."""
    B, scalings, offs = weights.B, weights.scalings, weights.slice_offsets
    S, out_features, R = B.shape
    n = weights.n_slices
    W = B.new_zeros(S * n * R, out_features)
    for s in range(S):
        for i in range(n):
            lo, hi = offs[i], offs[i + 1]
            W[(s * n + i) * R : (s * n + i + 1) * R, lo:hi] = (B[s, lo:hi] * scalings[s, i].to(B.dtype)).T
    return W


@functools.cache
def _packable() -> tuple[torch.dtype, ...]:
    return packable_dtypes() if onednn_linear_available() else ()


_DENSE_MAX_SLOTS = 8


def _slot_groups(info: LoRABatchInfo) -> list[tuple[int, torch.Tensor]]:
    """(slot, int64 row indices) for every adapter slot of a one-token-per-segment batch."""
    route = info.host_derived
    if "groups" not in route:
        rows: dict[int, list[int]] = {}
        for t, slot in enumerate(info.seg_slots_host):
            if slot >= 0:
                rows.setdefault(slot, []).append(t)
        route["groups"] = [
            (slot, torch.tensor(r, dtype=torch.long, device=info.device)) for slot, r in rows.items()
        ]
    return route["groups"]


def _slot_mask(info: LoRABatchInfo, n_slices: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, live rows of :func:`_live_rows`]: 1 over the rows of each token's own slot (all zeros for
    base-only tokens)."""
    key = f"mask-{n_slices}-{dtype}"
    mask = info.host_derived.get(key)
    if mask is None:
        token_slots = info.token_slots[: info.num_tokens].long()
        row_slots = torch.tensor(
            [s for s, r in enumerate(info.ranks_host) for _ in range(n_slices * r)], device=info.device
        )
        mask = (token_slots[:, None] == row_slots[None, :]).to(dtype)
        info.host_derived[key] = mask
    return mask
