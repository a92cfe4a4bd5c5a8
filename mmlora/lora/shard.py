"""Sharded LoRA for tensor parallelism, with no communication in the forward.

Column-parallel targets (qkv, gate_up): A is replicated (shrink reads the full x) and B keeps this rank's
output rows, so each rank expands into its own slice. Row-parallel targets (o, down): A keeps this rank's
input columns and B is replicated; the rank adds ``(x_r A_r^T) B^T`` to its partial output before the
layer's all-reduce, whose sum is then ``x W^T + (x A^T) B^T``.

Adapters are read, validated and cached on rank 0 only. When rank 0 writes an adapter into a device slot
(:class:`ShardedLoRAPool`), it cuts each worker's share and sends it as two tensors: a manifest (rank and
scaling of every slice) and the flat weights; a worker rebuilds its shard and writes the same slot.
"""

from __future__ import annotations

import torch
from torch import nn

from mmlora.distributed.state import recv, send, tp_group
from mmlora.distributed.step import Command, send_header
from mmlora.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from mmlora.lora.adapter import LoadedAdapter, LoRAModuleWeights
from mmlora.lora.pool import LoRAPool
from mmlora.lora.spec import LoRAModelSpec


class AdapterSharder:
    """Cuts a full adapter down to any rank's share, by the sharding rule of each target's base linear
    (``bases``: target name -> the base linear of layer 0; every layer is sharded alike)."""

    def __init__(self, bases: dict[str, nn.Module]) -> None:
        self.bases = bases

    def shard(self, adapter: LoadedAdapter, rank: int) -> LoadedAdapter:
        weights = {}
        for (layer, target), w in adapter.weights.items():
            base = self.bases[target]
            A, B = list(w.A), list(w.B)
            for i, (a, b) in enumerate(zip(w.A, w.B)):
                if a is None:
                    continue
                if isinstance(base, ColumnParallelLinear):
                    B[i] = base.shard_rows(b, i, rank)
                elif isinstance(base, RowParallelLinear):
                    A[i] = base.shard_cols(a, rank)
            weights[(layer, target)] = LoRAModuleWeights(tuple(A), tuple(B), w.scalings)
        return LoadedAdapter(adapter.path, adapter.rank, weights, adapter.config, adapter.nbytes)


def _slices(spec: LoRAModelSpec) -> list[tuple[int, str, int]]:
    """(layer, target, slice) of every slice of the pool, in the order messages list them."""
    return [
        (layer, t.name, i)
        for layer in range(spec.num_layers)
        for t in spec.targets
        for i in range(len(t.slices))
    ]


def send_shard(
    shard: LoadedAdapter, spec: LoRAModelSpec, dst: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Send one rank's shard: the rank and scaling of every slice, then all A and B flattened (from
    ``device``: the CPU with gloo, rank 0's GPU with NCCL)."""
    ranks, scalings, flat = [], [], []
    for layer, target, i in _slices(spec):
        w = shard.weights.get((layer, target))
        a = None if w is None else w.A[i]
        ranks.append(0 if a is None else a.shape[0])
        scalings.append(0.0 if a is None else w.scalings[i])
        if a is not None:
            flat += [a.reshape(-1), w.B[i].reshape(-1)]
    on = dict(device=device)
    send(torch.tensor(ranks, dtype=torch.int64, **on), dst)
    send(torch.tensor(scalings, dtype=torch.float64, **on), dst)
    send(torch.cat(flat).to(device, dtype) if flat else torch.zeros(0, dtype=dtype, **on), dst)


def recv_shard(
    spec: LoRAModelSpec, dtype: torch.dtype, device: torch.device, adapter_rank: int
) -> LoadedAdapter:
    """Receive what :func:`send_shard` sent this rank (into ``device``)."""
    slices = _slices(spec)
    ranks = recv(torch.zeros(len(slices), dtype=torch.int64, device=device)).tolist()
    scalings = recv(torch.zeros(len(slices), dtype=torch.float64, device=device)).tolist()
    targets = {t.name: t for t in spec.targets}
    shapes = []
    for (_, target, i), r in zip(slices, ranks):
        if r:
            t = targets[target]
            shapes += [(r, t.in_features), (t.out_features[i], r)]
    flat = recv(torch.zeros(sum(a * b for a, b in shapes), dtype=dtype, device=device))
    tensors = iter(flat.split([a * b for a, b in shapes]))
    parts: dict[tuple[int, str], tuple[list, list, list]] = {}
    for (layer, target, i), r, s in zip(slices, ranks, scalings):
        n = len(targets[target].slices)
        A, B, S = parts.setdefault((layer, target), ([None] * n, [None] * n, [0.0] * n))
        if r:
            t = targets[target]
            A[i] = next(tensors).view(r, t.in_features)
            B[i] = next(tensors).view(t.out_features[i], r)
            S[i] = s
    weights = {
        key: LoRAModuleWeights(tuple(A), tuple(B), tuple(S))
        for key, (A, B, S) in parts.items()
        if any(a is not None for a in A)
    }
    return LoadedAdapter("", adapter_rank, weights, {}, int(flat.numel() * flat.element_size()))


class ShardedLoRAPool(LoRAPool):
    """Rank 0's pool at tp_size > 1: its slots hold rank 0's shards (the pool's spec has shard sizes),
    and every slot write or drop is repeated on the workers, each with its own shard."""

    def __init__(self, sharder: AdapterSharder, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sharder = sharder

    def write_slot(self, slot: int, adapter: LoadedAdapter) -> None:
        super().write_slot(slot, self.sharder.shard(adapter, 0))
        send_header(Command.WRITE_SLOT, slot, adapter.rank)
        for dst in range(1, tp_group().size):
            send_shard(self.sharder.shard(adapter, dst), self.spec, dst, self.dtype, self.device)

    def clear_slot(self, slot: int) -> None:
        super().clear_slot(slot)
        send_header(Command.CLEAR_SLOT, slot)
