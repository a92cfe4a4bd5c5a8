"""The staged shrink: a decode step's LoRA shrink computed by the base GEMM itself (``lora_stage_slots``).

A decode step's LoRA shrinks are latency-bound: four small kernels a layer that read the batch's adapters'
A at about a third of the copy bandwidth (issue 13). The CPU path already computes the shrink inside the
base GEMM, over the module's stacked ``[W; A]`` (``TorchGatherBackend.fused_linear``). This does the same on
the GPU for decode CUDA graphs: every LoRA module's base weight becomes the first rows of one buffer

    W_cat [out + C * n * R, in]   rows 0..out: the base weight W (the base layer's weight is a view of them)
                                  then C stage positions of n * R rows: one adapter's A each

so ``F.linear(x, W_cat)`` gives ``[T, out + C*n*R]``: the base output, then the shrink of every staged
adapter for every row. The expand reads each row's own adapter's columns (its slot's position in
:attr:`ShrinkStage.h_pos`), and the shrink kernels do not run. The positions hold copies of adapters' A,
made when an adapter enters a step's batch and is not staged yet (least recently used positions are
reused), and dropped when the pool rewrites the slot. Other steps (prefill, mixed, eager) run the base
weight ``W`` as before: it is a contiguous prefix of ``W_cat``.

The GEMM reads all C positions in every decode step, used or not, so C trades bytes against the batches
that fit (a batch of more distinct adapters than C runs the plain kernels). Unpaged pools on one device
only (the routing layer, :meth:`~mmlora.lora.routing.ForwardRouting.prepare_replay`, decides per step).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from mmlora.forward.host_copy import to_device
from mmlora.forward.lora import LoRAWeights


class StagedModule:
    """One LoRA module's ``W_cat`` (see the module docstring): built from the base layer's weight, which
    becomes a view of its first rows, and the bias padded with zeros for the stage's columns."""

    def __init__(self, base: nn.Linear, weights: LoRAWeights, capacity: int) -> None:
        W = base.weight
        out_f, in_f = W.shape
        self.out_features = out_f
        self.weights = weights
        self.rows_per_position = weights.A.shape[1]  # n * R
        rows = capacity * self.rows_per_position
        cat = torch.zeros(out_f + rows, in_f, dtype=W.dtype, device=W.device)
        cat[:out_f].copy_(W)
        base.weight.data = cat[:out_f]  # the base keeps its own parameter, now a view of W_cat
        self.W_cat = cat
        self.tail = cat[out_f:].view(capacity, self.rows_per_position, in_f)
        bias = getattr(base, "bias", None)
        self.bias_cat = None
        if bias is not None:
            self.bias_cat = torch.zeros(out_f + rows, dtype=bias.dtype, device=bias.device)
            self.bias_cat[:out_f].copy_(bias)

    def linear(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(base output [T, out], every position's shrink [T, C*n*R]): two column views of one GEMM's
        result (row stride out + C*n*R)."""
        y = torch.nn.functional.linear(x, self.W_cat, self.bias_cat)
        return y[..., : self.out_features], y[..., self.out_features :]


class ShrinkStage:
    """``capacity`` stage positions shared by every LoRA module, and which pool slot each holds.

    ``h_pos [num_slots] int32`` (device): each slot's position, -1 where not staged; the expand reads it
    (``H_POS`` in :func:`mmlora.backends.triton_sgmv_kernels._sgmv_expand_kernel`)."""

    def __init__(self, capacity: int, num_slots: int, device: torch.device) -> None:
        if capacity < 1:
            raise ValueError(f"ShrinkStage: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.modules: list[StagedModule] = []
        self.h_pos = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
        self._position: OrderedDict[int, int] = OrderedDict()  # slot -> position, least recent first
        self.copies = 0  # adapters copied into positions (a benchmark's count)

    def add(self, base: nn.Linear, weights: LoRAWeights) -> StagedModule:
        """Stage one module: its ``W_cat`` (the base's weight becomes a view of it)."""
        if weights.pages > 1:
            raise ValueError("ShrinkStage: a paged pool's A is not one block of rows per slot")
        module = StagedModule(base, weights, self.capacity)
        self.modules.append(module)
        return module

    def ensure(self, slots: Iterable[int]) -> bool:
        """Stage every adapter slot among ``slots`` (-1: none), copying the missing ones' A into free or
        least recently used positions (on the current stream, after the slot's load); False, changing
        nothing, when they are more than the positions."""
        wanted = {s for s in slots if s >= 0}
        if len(wanted) > self.capacity:
            return False
        for slot in wanted & self._position.keys():
            self._position.move_to_end(slot)
        missing = sorted(wanted - self._position.keys())
        if not missing:
            return True
        used = set(self._position.values())
        free = [p for p in range(self.capacity) if p not in used]
        changed: dict[int, int] = {}
        for slot in missing:
            if free:
                pos = free.pop(0)
            else:  # the least recent slot this batch does not use
                old = next(s for s in self._position if s not in wanted)
                pos = self._position.pop(old)
                changed[old] = -1
            self._position[slot] = pos
            changed[slot] = pos
        dst = [m.tail[self._position[s]] for s in missing for m in self.modules]
        src = [m.weights.A[s] for s in missing for m in self.modules]
        if dst:
            torch._foreach_copy_(dst, src)
        self.copies += len(missing)
        self._publish(changed)
        return True

    def forget(self, slot: int) -> None:
        """The pool rewrote or emptied ``slot``: its staged copy is stale."""
        if self._position.pop(slot, None) is not None:
            self._publish({slot: -1})

    def position_of(self, slot: int) -> int | None:
        return self._position.get(slot)

    def _publish(self, changed: dict[int, int]) -> None:
        # One host-to-device copy of the changed entries (a kernel on the current stream, no sync).
        device = self.h_pos.device
        index = to_device(list(changed), torch.long, device)
        self.h_pos.index_copy_(0, index, to_device(list(changed.values()), torch.int32, device))
