"""The dense CPU pieces of torch-gather: every adapter slot's live rank rows as one matrix.

A CPU decode step has few rows and few adapter slots, so torch-gather multiplies every row by every
slot's live rank rows (a rank-8 adapter in a rank-64 pool costs 8 rows, not 64) and zeroes the columns
of the other slots with a mask (:func:`slot_mask`): a fixed, small number of calls per module, whatever
the adapters and however the rows group into segments.

:class:`ShrinkFused` goes one step further: the base weight and the live rows of A stacked as one
packed ``[W; A_live]`` (:func:`~mmlora.backends.onednn.pack_weight`), so that the base GEMM computes the
shrink too (``K`` more output columns beside ``out``). Inside a forward a oneDNN call cost about 25 us on
issue 21's 2-core EPYC where it computes about 8 (the C panel GEMM that replaced it there still about 7 us),
more than the shrink's FLOPs; SmolLM2 with four rank-8 adapters adds 2-10% columns to each base GEMM
instead. The
stacked weight stands in for the base layer's own packed copy (the layer frees that one), so the module
keeps one packed weight; a batch without adapter rows reads the first ``out`` columns.

After it, where the C kernels are built (:mod:`mmlora.backends.cpu_kernels`, expand: :mod:`mmlora.backends.cpu_expand`), :meth:`ShrinkFused.add_expand`
adds each row's own slot's expand in one call (no mask, no multiply by the other slots' zero blocks, no
separate add); elsewhere the caller masks the shrink and multiplies by the packed expand matrix.
"""

from __future__ import annotations

import dataclasses

import torch

from mmlora.backends import cpu_expand, cpu_kernels, cpu_plan
from mmlora.backends.onednn import pack_weight
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights

#: :class:`ShrinkFused` stacks a module's live rank rows under its base weight only while they are at
#: most this share of its output width: batches without adapter rows compute (and drop) those columns.
STACK_SHARE = 0.25


def live_rows(n_slices: int, R: int, ranks: list[int]) -> torch.Tensor:
    """Rows of the flattened [S * n * R] slot layout that hold rank (slot s, slice i: its first
    ``ranks[s]`` rows), slot-major; the rest is rank padding (zeros). :func:`slot_mask` orders its
    columns the same way."""
    rows = [
        (s * n_slices + i) * R + j for s, r in enumerate(ranks) for i in range(n_slices) for j in range(r)
    ]
    return torch.tensor(rows, dtype=torch.long)


def expand_matrix(weights: LoRAWeights) -> torch.Tensor:
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


def live_weights(weights: LoRAWeights, ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(A's live rows [K, in], the expand matrix's live rows [K, out]) over every slot."""
    A = weights.A
    rows = live_rows(weights.n_slices, A.shape[1] // weights.n_slices, ranks)
    return A.reshape(-1, A.shape[2])[rows], expand_matrix(weights)[rows]


def expand_rows(info: LoRABatchInfo, n_slices: int) -> torch.Tensor:
    """:func:`mmlora.backends.cpu_expand.expand_rows` of the batch's tokens (each token's first live
    column and rank), made once per forward (``info.host_derived``)."""
    key = ("expand-rows", n_slices)
    rows = info.host_derived.get(key)
    if rows is None:
        rows = info.host_derived[key] = torch.empty(info.num_tokens, 2, dtype=torch.int32)

        def fill() -> None:  # from the host lists only: a CPU plan re-runs it before each replay
            slots = [s for n, s in zip(info.seg_lens_host, info.seg_slots_host) for _ in range(n)]
            rows.copy_(cpu_expand.expand_rows(slots, info.ranks_host, n_slices))

        cpu_plan.host_input(fill)
    return rows


def slot_mask(
    info: LoRABatchInfo, n_slices: int, dtype: torch.dtype, rows: int | None = None
) -> torch.Tensor:
    """[rows (default T), live rows of :func:`live_rows`] in ``dtype``: 1 over the columns of each token's
    own slot, 0 elsewhere (all zeros for base-only tokens and for rows past T, the padding of a packed
    matmul). Made once per forward (``info.host_derived``)."""
    T = info.num_tokens
    rows = T if rows is None else rows
    key = ("mask", n_slices, dtype, rows)
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


@dataclasses.dataclass
class ShrinkFused:
    """One module's stacked weights (see the module docstring), all in the base weight's dtype.

    WA       packed [out + K, in]: the base weight, then the K live rank rows of every slot's A
    bias     [out + K] (the base bias, zeros past it) or None
    E, eoff  the live expand matrix [K, out], compact (each row only its slice's columns, a slot's
             rows one run: :func:`cpu_expand.compact_expand`) for :meth:`add_expand`;
             :meth:`packed_expand` unfolds and packs it once for the torch path
    offsets  int64 [n_slices + 1]: the slice offsets
    """

    B: torch.Tensor  # the module's B view, base weight and bias: to tell a reused data pointer apart
    weight: torch.Tensor
    bias_src: torch.Tensor | None
    key: tuple  # the version counters of A, B, scalings, the weight and bias, and the slot ranks
    out_features: int
    live_rows: int
    WA: torch.Tensor
    bias: torch.Tensor | None
    E: torch.Tensor
    eoff: torch.Tensor
    offsets: torch.Tensor
    row_slices: list[int]
    _E_packed: torch.Tensor | None = None
    _expand_call: cpu_expand.ExpandCall | None = None

    def packed_expand(self) -> torch.Tensor | None:
        """packed [out, K]: the expand matrix transposed for ``packed_matmul`` (None when K is 0), made on
        first use (only the torch path, where the C kernels are off or not built, asks for it)."""
        if self._E_packed is None and self.live_rows:
            offs = self.offsets.tolist()
            W = self.E.new_zeros(self.live_rows, self.out_features)
            for k, (at, i) in enumerate(zip(self.eoff.tolist(), self.row_slices)):
                W[k, offs[i] : offs[i + 1]] = self.E[at : at + offs[i + 1] - offs[i]]
            self._E_packed = pack_weight(W.T.contiguous())
        return self._E_packed

    def add_expand(self, yk: torch.Tensor, info: LoRABatchInfo, n_slices: int) -> bool:
        """``yk`` [T, out + K] from the stacked GEMM: add each adapter row's expand of its own slot's
        shrink columns to its first ``out`` columns, in place, in one C call; True when done, False
        where the C kernels are off or not built (the caller then masks and multiplies)."""
        if not self.live_rows or not cpu_kernels.available() or yk.dtype not in cpu_expand.EXPAND_DTYPES:
            return False
        if self._expand_call is None:
            self._expand_call = cpu_expand.ExpandCall(self.E, self.eoff, self.offsets, self.out_features)
        self._expand_call(yk, expand_rows(info, n_slices))
        return True

    @staticmethod
    def key_of(
        weight: torch.Tensor, bias: torch.Tensor | None, weights: LoRAWeights, ranks: list[int]
    ) -> tuple:
        versions = (weights.A._version, weights.B._version, weights.scalings._version, weight._version)
        return (*versions, None if bias is None else bias._version, tuple(ranks))

    def matches(
        self, weight: torch.Tensor, bias: torch.Tensor | None, weights: LoRAWeights, key: tuple
    ) -> bool:
        return self.B is weights.B and self.weight is weight and self.bias_src is bias and self.key == key

    @classmethod
    def build(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        weights: LoRAWeights,
        ranks: list[int],
        key: tuple,
    ) -> ShrinkFused | None:
        """The stacked weights, or None where the live rank rows exceed :data:`STACK_SHARE` of the
        output width."""
        out_features = weight.shape[0]
        K = weights.n_slices * sum(ranks)  # the live rank rows
        if K > STACK_SHARE * out_features:  # noqa: SIM300 (reads as the rule in the docstring)
            return None
        A_live, W_live = live_weights(weights, ranks)
        with torch.no_grad():
            WA = pack_weight(torch.cat([weight.detach(), A_live.to(weight.dtype)]))
            stacked_bias = None if bias is None else torch.cat([bias.detach(), bias.new_zeros(K)])
            row_slices = cpu_expand.live_row_slices(weights.n_slices, ranks)
            E, eoff = cpu_expand.compact_expand(
                W_live.to(weight.dtype), row_slices, list(weights.slice_offsets)
            )
        offsets = torch.tensor(weights.slice_offsets, dtype=torch.int64)
        return cls(
            weights.B, weight, bias, key, out_features, K, WA, stacked_bias, E, eoff, offsets, row_slices
        )
