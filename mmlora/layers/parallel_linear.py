"""Megatron-style sharded linears. Both subclass ``PackedLinear`` (an ``nn.Linear`` whose weight the CPU
prepacks for its packed matmul) holding this rank's shard, and say which
part of a full tensor any rank holds, so that checkpoint weights and LoRA adapters (rank 0 cuts every
rank's share) are sharded by the one rule.

ColumnParallelLinear  output rows split: ``y_r = x W_r^T + b_r``, no communication. Packed layers (qkv,
                      gate_up) split each packed slice on its own, in whole units (heads, or single rows);
                      a slice of fewer heads than ranks (GQA KV heads) is replicated: each rank keeps the
                      head its query heads attend with.
RowParallelLinear     input columns split: ``y = sum_r x_r W_r^T + b``, one all-reduce. ``partial`` is this
                      rank's term (the bias on rank 0 only); LoRALinear adds the row-parallel delta to it
                      before ``reduce``, so LoRA needs no communication of its own.
At tp_size 1 both are plain linears over the full weight.
"""

from __future__ import annotations

import torch
from torch import nn

from mmlora.distributed.state import all_reduce, tp_group
from mmlora.layers.packed_linear import PackedLinear

Units = tuple[int, int]  # (number of units, rows or columns per unit): (heads, head_dim) or (n, 1)


def unit_range(units: Units, rank: int, size: int, what: str) -> tuple[int, int]:
    """(start, length) in rows of ``rank``'s units; with fewer units than ranks, the one unit that
    ``rank``'s query heads share (replicated over ``size / units`` ranks)."""
    count, width = units
    if count >= size:
        if count % size:
            raise ValueError(f"tp_size={size} does not divide {what} ({count})")
        n = count // size
        return rank * n * width, n * width
    if size % count:
        raise ValueError(f"tp_size={size} is neither a divisor nor a multiple of {what} ({count})")
    return rank * count // size * width, width


class ColumnParallelLinear(PackedLinear):
    """``slice_units`` per packed slice, in output order; ``names`` of the slices for errors."""

    def __init__(
        self, in_features: int, slice_units: tuple[Units, ...], bias: bool, names: tuple[str, ...]
    ) -> None:
        group = tp_group()
        rows = tuple(unit_range(u, group.rank, group.size, n) for u, n in zip(slice_units, names))
        super().__init__(in_features, sum(n for _, n in rows), bias=bias)
        self.slice_units, self.names, self.tp_size = tuple(slice_units), names, group.size
        self.full_output_sizes = tuple(c * w for c, w in slice_units)
        self.slice_rows = rows
        self.output_sizes = tuple(n for _, n in rows)

    def rows_of(self, rank: int) -> tuple[tuple[int, int], ...]:
        """(start, length) of ``rank``'s rows inside each slice."""
        return tuple(unit_range(u, rank, self.tp_size, n) for u, n in zip(self.slice_units, self.names))

    def shard_rows(self, full: torch.Tensor, slice_idx: int | None, rank: int | None = None) -> torch.Tensor:
        """``rank``'s (default: this rank's) rows of a full tensor whose dim 0 is slice ``slice_idx``, or
        all slices packed when None."""
        rows = self.slice_rows if rank is None else self.rows_of(rank)
        if slice_idx is not None:
            return full.narrow(0, *rows[slice_idx])
        parts, offset = [], 0
        for size, (start, n) in zip(self.full_output_sizes, rows):
            parts.append(full.narrow(0, offset + start, n))
            offset += size
        return torch.cat(parts)


class RowParallelLinear(PackedLinear):
    """Input ``in_units`` split over the ranks; ``name`` of the input for errors."""

    def __init__(self, in_units: Units, out_features: int, bias: bool, name: str) -> None:
        group = tp_group()
        cols = unit_range(in_units, group.rank, group.size, name)
        super().__init__(cols[1], out_features, bias=bias)
        self.in_units, self.name, self.tp_size, self.rank = in_units, name, group.size, group.rank
        self.full_in_features = in_units[0] * in_units[1]
        self.in_cols = cols

    def cols_of(self, rank: int) -> tuple[int, int]:
        return unit_range(self.in_units, rank, self.tp_size, self.name)

    def shard_cols(self, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """``rank``'s (default: this rank's) input columns of a full [*, full_in_features] tensor."""
        return full.narrow(-1, *(self.in_cols if rank is None else self.cols_of(rank)))

    @property
    def partial_bias(self) -> torch.Tensor | None:
        """The bias this rank's term adds: counted once, on rank 0."""
        return self.bias if self.rank == 0 else None

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the output."""
        return self.linear(x, self.partial_bias)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return all_reduce(partial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))


def shard_full_weight(module: nn.Module, full: torch.Tensor, slice_idx: int | None = None) -> torch.Tensor:
    """This rank's part of a full weight or bias of ``module`` (slice ``slice_idx`` of a packed one, or
    all slices packed); other modules are replicated and keep all of it."""
    if isinstance(module, ColumnParallelLinear):
        return module.shard_rows(full, slice_idx)
    if isinstance(module, RowParallelLinear) and full.dim() == 2:
        return module.shard_cols(full)
    return full


def full_weight_shape(module: nn.Linear) -> tuple[int, ...]:
    if isinstance(module, ColumnParallelLinear):
        return sum(module.full_output_sizes), module.in_features
    if isinstance(module, RowParallelLinear):
        return module.out_features, module.full_in_features
    return tuple(module.weight.shape)
