"""torch-gather: the reference backend in plain PyTorch, right for any mix of ranks and base-only rows.

Decode-like batches (one token per segment) gather each token's A/B by slot and use one batched
matmul; prefill-like batches loop over the (few) segments with one dense matmul each, which avoids
materialising a [tokens, R, in] gather. Runs on CPU and GPU.

On CPU, a batch of at most :data:`~mmlora.backends.onednn.PACKED_MAX_ROWS` tokens over few slots (a
decode step, a short chunk) takes a dense path: every slot's shrink in one matmul, the other slots' rows
masked to zeros, and the expand either fused into the base GEMM (:meth:`TorchGatherBackend.fused_linear`,
which the LoRA layer tries first) or one more matmul, with oneDNN-prepacked copies where
:mod:`mmlora.backends.onednn` says packing pays. Larger CPU batches whose adapter segments outnumber
their slots (decode-like ones, prefills of many prompts on few adapters) group tokens by slot (from the
host mirrors, no sync to pay) and run one dense matmul per distinct adapter: the per-token gather copies
every token's A and B, which on CPU costs more than the matmuls themselves. On GPU the gather path
stays, as it reads only device tensors and so is capturable in CUDA graphs.
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
    row_bucket,
)
from mmlora.backends.registry import register_backend
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights


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
        self._fused_cache: dict[int, _FusedWeights] = {}

    def fused_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        weights: LoRAWeights,
        info: LoRABatchInfo,
    ) -> torch.Tensor | None:
        """A CPU decode step (at most PACKED_MAX_ROWS tokens over few slots, a packable dtype): the
        base GEMM and the LoRA expand as one oneDNN matmul, ``[x | h] @ [W | W_lora].T + bias``, where
        ``h = (x @ A_live.T) * mask`` is every slot's shrink with the other slots' columns zeroed. At
        decode sizes a oneDNN call costs about 10 us before it multiplies anything, more than a rank-8
        expand's FLOPs, so the expand rides on the base call. The shrink is oneDNN's too: MKL's ``mm``
        is quicker alone (16 rows, K = 32: 8 against 14 us) but measured no quicker inside a forward;
        the mask as oneDNN's post-op was slower. Costs a second packed copy of the
        module's weight (beside the base layer's own, which base-only steps keep using; SmolLM2-135M in
        fp32: 465 MB), rebuilt when an adapter slot or the base weight changes.

        A prefill whose adapter segments outnumber their slots (many prompts on few adapters) runs the
        same in PACKED_MAX_ROWS-row pieces (as PackedLinear runs a prefill) where the module's live rank
        rows are at most 1 / _PREFILL_RANK_SHARE of its input width: every row then multiplies every
        slot's rank rows, a FLOP share that grows with the slots and ranks, against the per-slot
        gathers' dozens of small calls (16 prompts x 12 tokens on 4 rank-8 adapters, SmolLM2: base-only
        over mixed 0.76-0.79 -> 0.83-0.87 per prefill forward).

        Every module runs this once per forward, so what depends only on the batch is decided once per
        forward (``info.host_derived``): at decode sizes the Python around the ops counts."""
        rows = info.host_derived.get("fused-rows")
        if rows is None:
            rows = info.host_derived["fused-rows"] = _fused_rows(x, info)
        T = info.num_tokens
        if not rows or x.dtype != rows[1] or x.dim() != 2 or x.shape[0] != T:
            return None
        fused = self._fused(weight, weights, info.ranks_host)
        if fused is None or (T > PACKED_MAX_ROWS and fused.live_rows * _PREFILL_RANK_SHARE > x.shape[1]):
            return None
        if rows[0] != T:
            x = torch.cat([x, x.new_zeros(rows[0] - T, x.shape[1])])
        mask = _slot_mask(info, weights.n_slices, x.dtype, rows[0])
        linear = torch.ops.mkldnn._linear_pointwise
        pieces = []
        for xp, mp in zip(x.split(PACKED_MAX_ROWS), mask.split(PACKED_MAX_ROWS)):
            h = linear(xp, fused.A, None, "none", [], "")
            h *= mp
            pieces.append(linear(torch.cat([xp, h], 1), fused.W, bias, "none", [], ""))
        y = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return y if rows[0] == T else y[:T]

    def _fused(self, weight: torch.Tensor, weights: LoRAWeights, ranks: list[int]) -> _FusedWeights | None:
        """The module's fused-path weights (None where it cannot fuse: dtypes that differ, an inference
        weight without the version counter a later write would be noticed by, a weight autograd
        records), cached as :meth:`_dense`'s and on the base weight's version."""
        A, B, scalings = weights.A, weights.B, weights.scalings
        cached = self._fused_cache.get(B.data_ptr())
        if (
            weight.is_inference()
            or not weight.dtype == A.dtype == B.dtype
            or (weight.requires_grad and torch.is_grad_enabled())  # autograd records (as PackedLinear)
        ):
            return None
        key = (A._version, B._version, scalings._version, weight._version, tuple(ranks))
        if cached is not None and cached.B is B and cached.weight is weight and cached.key == key:
            return cached
        A_live, W_live = _live_weights(weights, ranks)
        W_cat = torch.cat([weight.detach(), W_live.T], 1)  # [out, in + live rows]
        fused = _FusedWeights(B, weight, key, A_live.shape[0], pack_weight(A_live), pack_weight(W_cat))
        self._fused_cache[B.data_ptr()] = fused
        return fused

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
        A_live, W_live = _live_weights(weights, ranks)
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


@dataclasses.dataclass
class _FusedWeights:
    B: torch.Tensor  # the module's B view and base weight, to tell a reused data pointer from the module
    weight: torch.Tensor
    key: tuple  # as _DenseWeights', and the base weight's version counter
    live_rows: int  # K: every slot's live rank rows
    A: torch.Tensor  # the live rows of A [K, in], packed
    W: torch.Tensor  # [out, in + K]: the base weight beside the live expand matrix's transpose, packed


def _live_weights(weights: LoRAWeights, ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(A's live rows [K, in], the expand matrix's live rows [K, out]) over every slot."""
    A = weights.A
    rows = _live_rows(weights.n_slices, A.shape[1] // weights.n_slices, ranks)
    return A.reshape(-1, A.shape[2])[rows], _expand_matrix(weights)[rows]


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


def _fused_rows(x: torch.Tensor, info: LoRABatchInfo) -> tuple[int, torch.dtype] | tuple[()]:
    """Whether this forward's batch takes :meth:`TorchGatherBackend.fused_linear`: (the row count its
    packed matmuls run at, the dtype) where it does, () where not (not the CPU, too many tokens or
    slots, a dtype oneDNN does not pay in, or autograd recording through x)."""
    T = info.num_tokens
    if (
        x.device.type != "cpu"
        or T <= 0
        or (T > PACKED_MAX_ROWS and not _by_slot(x, info))
        or info.num_slots > _DENSE_MAX_SLOTS
        or x.dtype not in _packable()
        or (torch.is_grad_enabled() and x.requires_grad)
    ):
        return ()
    full, rest = divmod(T, PACKED_MAX_ROWS)
    return (full * PACKED_MAX_ROWS + (row_bucket(rest) if rest else 0), x.dtype)


@functools.cache
def _packable() -> tuple[torch.dtype, ...]:
    return packable_dtypes() if onednn_linear_available() else ()


_DENSE_MAX_SLOTS = 8
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


def _slot_mask(
    info: LoRABatchInfo, n_slices: int, dtype: torch.dtype, rows: int | None = None
) -> torch.Tensor:
    """[rows (default T), live rows of :func:`_live_rows`]: 1 over the columns of each token's own slot
    (all zeros for base-only tokens and for rows past T, the padding of a packed matmul)."""
    T = info.num_tokens
    rows = T if rows is None else rows
    key = f"mask-{n_slices}-{dtype}-{rows}"
    mask = info.host_derived.get(key)
    if mask is None:
        token_slots = info.token_slots[:T].long()
        if rows > T:
            token_slots = torch.cat([token_slots, token_slots.new_full((rows - T,), -1)])
        row_slots = torch.tensor(
            [s for s, r in enumerate(info.ranks_host) for _ in range(n_slices * r)], device=info.device
        )
        mask = (token_slots[:, None] == row_slots[None, :]).to(dtype)
        info.host_derived[key] = mask
    return mask
