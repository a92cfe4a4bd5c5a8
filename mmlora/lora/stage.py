"""The staged shrink: a decode step's LoRA shrink computed by the base GEMM itself (``lora_stage_slots``).

A decode step's LoRA shrinks are latency-bound: four small kernels a layer that read the batch's adapters'
A at about a third of the copy bandwidth (issue 13). The CPU path already computes the shrink inside the
base GEMM, over the module's stacked ``[W; A]`` (``TorchGatherBackend.fused_linear``). This does the same on
the GPU for decode CUDA graphs: every LoRA module's base weight becomes the first rows of one buffer

    W_cat [out + C * n * R, in]   rows 0..out: the base weight W (the base layer's weight is a view of them)
                                  then C stage positions of n * R rows: one adapter's A each
                                  (a paged pool's positions are pages of n * U rows, see below)

so ``F.linear(x, W_cat)`` gives ``[T, out + C*n*R]``: the base output, then the shrink of every staged
adapter for every row. The expand reads each row's own adapter's columns (its slot's position in
:attr:`ShrinkStage.h_pos`), and the shrink kernels do not run. The positions hold copies of adapters' A,
made when an adapter enters a step's batch and is not staged yet (least recently used positions are
reused), and dropped when the pool rewrites the slot. Other steps (prefill, mixed, eager) run the base
weight ``W`` as before: it is a contiguous prefix of ``W_cat``.

In a pool paged by rank tile (``lora_page_rank`` U) a position is one page: an adapter whose slot holds
k pages takes k consecutive positions, aligned to k as the pool places them (:mod:`mmlora.lora.pages`), and
its columns come page by page in the order of A's rows. A rank-8 adapter then costs the GEMM one page, a
rank-64 one four, and a mix its pages' mean.

A staged GEMM reads a prefix of the positions: all C (layout ``staged``), or the first C/2 or C/4
(``staged/2``, ``staged/4``), the narrowest that holds the batch's adapters. :meth:`ShrinkStage.ensure`
places them within the narrowest prefix that can hold them all, copying again an adapter staged past it
(a copy of an adapter's A is tens of MB, tens of microseconds; a prefix half as wide saves every step
the bytes of half the positions). So a step reads at most twice its adapters' A, or a quarter of the
positions where they take fewer, and a batch whose adapters need more positions than C runs the plain
kernels. One device only (the routing layer, :meth:`~mmlora.lora.routing.ForwardRouting.prepare_replay`,
decides per step).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from mmlora.forward.host_copy import to_device
from mmlora.forward.lora import STAGED_LAYOUTS, LoRAWeights
from mmlora.forward.stage_policy import worth_staging
from mmlora.lora.pages import PageMap, pages_for


class StagedModule:
    """One LoRA module's ``W_cat`` (see the module docstring): built from the base layer's weight, which
    becomes a view of its first rows, and the bias padded with zeros for the stage's columns."""

    def __init__(self, base: nn.Linear, weights: LoRAWeights, capacity: int) -> None:
        W = base.weight
        out_f, in_f = W.shape
        self.out_features = out_f
        # Each slot's A as pages [S, k, rows, in] (one page of n * R rows when unpaged).
        self.slot_pages = weights.A if weights.pages > 1 else weights.A.unsqueeze(1)
        self.rows_per_position = self.slot_pages.shape[2]  # n * U, or n * R unpaged
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

    def linear(self, x: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(base output [T, out], the first ``positions`` positions' shrinks [T, positions * rows per
        position]): two column views of one GEMM's result over a prefix of ``W_cat``."""
        rows = self.out_features + positions * self.rows_per_position
        bias = None if self.bias_cat is None else self.bias_cat[:rows]
        y = torch.nn.functional.linear(x, self.W_cat[:rows], bias)
        return y[..., : self.out_features], y[..., self.out_features :]


class ShrinkStage:
    """``capacity`` stage positions shared by every LoRA module, and which pool slot each holds.

    ``h_pos [num_slots] int32`` (device): each slot's (first) position, -1 where not staged; the expand
    reads it (``H_POS`` in :func:`mmlora.backends.triton_sgmv_kernels._sgmv_expand_kernel`). With
    ``page_rank`` (a paged pool of ``max_pages`` pages a slot) a slot takes the pages its rank does
    (:meth:`set_rank`), else one position."""

    def __init__(
        self,
        capacity: int,
        num_slots: int,
        device: torch.device,
        page_rank: int | None = None,
        max_pages: int = 1,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"ShrinkStage: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.page_rank = page_rank
        self.max_pages = max_pages if page_rank is not None else 1
        self.modules: list[StagedModule] = []
        self.h_pos = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
        self._position: OrderedDict[int, int] = OrderedDict()  # slot -> first position, least recent first
        self._map = PageMap(capacity)  # owner of each position (a slot)
        self._pages = [1] * num_slots  # positions each slot's adapter takes
        self.copies = 0  # adapters copied into positions (a benchmark's count)
        # The staged graph layouts, narrowest first: those whose widths differ and are >= 1.
        widths: dict[int, str] = {}
        for layout, divisor in STAGED_LAYOUTS.items():
            if capacity // divisor >= 1:
                widths.setdefault(capacity // divisor, layout)
        self.layouts = tuple(widths[w] for w in sorted(widths))

    @staticmethod
    def module_nbytes(base: nn.Linear, weights: LoRAWeights, capacity: int) -> int:
        """The bytes ``capacity`` positions add to one module (what :meth:`nbytes` counts for it once added)."""
        rows = capacity * weights.A.shape[-2]  # a position: a page's n * U rows, or n * R unpaged
        bias = 0 if getattr(base, "bias", None) is None else rows * base.bias.element_size()
        return rows * base.weight.shape[1] * base.weight.element_size() + bias

    def add(self, base: nn.Linear, weights: LoRAWeights) -> StagedModule:
        """Stage one module: its ``W_cat`` (the base's weight becomes a view of it)."""
        if weights.pages != self.max_pages:
            raise ValueError(
                f"ShrinkStage: {weights.pages} pages a slot, the stage was made for {self.max_pages}"
            )
        module = StagedModule(base, weights, self.capacity)
        self.modules.append(module)
        return module

    def set_rank(self, slot: int, rank: int) -> None:
        """The pool wrote (or emptied, rank 0) ``slot``: its staged copy is stale, and in a paged pool its
        adapter takes the positions of its pages."""
        self.forget(slot)
        if self.page_rank is not None:
            self._pages[slot] = pages_for(max(rank, 1), self.page_rank, self.max_pages)

    def _fit(self, wanted: set[int]) -> tuple[int, int] | None:
        """(positions the ``wanted`` slots' adapters take, the narrowest staged layout's width that holds
        them), None when they need more than every position."""
        need = sum(self._pages[s] for s in wanted)
        if need > self.capacity:
            return None
        return need, next(w for w in map(self.width, self.layouts) if w >= need)

    def _fit_if_worth(self, slots: Iterable[int]) -> tuple[set[int], tuple[int, int] | None]:
        """(the adapter slots among ``slots``, their :meth:`_fit` or None when they do not fit or the step
        is not worth staging: :func:`~mmlora.forward.stage_policy.worth_staging`)."""
        rows = [s for s in slots if s >= 0]
        wanted = set(rows)
        fit = self._fit(wanted)
        return wanted, fit if fit is not None and worth_staging(len(rows), len(wanted), *fit) else None

    def worth(self, slots: Iterable[int]) -> bool:
        """Whether a decode step over ``slots`` (-1: a row without adapter) should take the stage: its adapters
        fit the positions, take enough of the narrowest layout that holds them, and have rows enough each
        (:func:`~mmlora.forward.stage_policy.worth_staging`)."""
        return self._fit_if_worth(slots)[1] is not None

    def ensure(self, slots: Iterable[int], when_worth: bool = False) -> bool:
        """Stage every adapter slot among ``slots`` (-1: none) within the narrowest layout's positions that
        can hold them, copying the missing ones' A there (on the current stream, after the slot's load):
        into free positions, else over the least recently used ones the batch does not use; an adapter
        staged past those positions is copied again into them. False, staging nothing, when they do not
        fit the positions together, or with ``when_worth`` when the step is not :meth:`worth` staging (the
        batch's fit is computed once for both)."""
        if when_worth:
            wanted, fit = self._fit_if_worth(slots)
        else:
            wanted = {s for s in slots if s >= 0}
            fit = self._fit(wanted)
        if fit is None:
            return False
        for slot in wanted & self._position.keys():
            self._position.move_to_end(slot)
        width = fit[1]
        # Kept where they are, the batch's staged adapters may leave no aligned window for the rest; placed
        # again together, largest first, they always fit: pages are powers of two, so each window size
        # divides the pages placed before it.
        plan = self._plan(wanted, width, repack=False) or self._plan(wanted, width, repack=True)
        if plan is None:
            return False
        self._apply(*plan)
        return True

    def _plan(
        self, wanted: set[int], width: int, repack: bool
    ) -> tuple[PageMap, list[int], list[tuple[int, int]]] | None:
        """(the map after, slots evicted, (slot, first position) placed) that puts every ``wanted`` slot
        in the first ``width`` positions, None if they cannot be; planned on a copy of the map, largest
        adapters first (aligned windows, as the pool's). Staged adapters of the batch stay where they are
        unless they are past ``width`` or ``repack``."""
        beyond = [
            s for s in wanted & self._position.keys() if repack or self._position[s] + self._pages[s] > width
        ]
        missing = sorted((wanted - self._position.keys()).union(beyond), key=lambda s: (-self._pages[s], s))
        if not missing:
            return self._map, [], []
        plan = self._map.copy()
        for slot in beyond:
            plan.release(self._position[slot])
        age = {slot: i for i, slot in enumerate(self._position)}
        evicted: list[int] = list(beyond)
        placed: list[tuple[int, int]] = []
        for slot in missing:
            where = plan.choose(self._pages[slot], lambda s: s not in wanted, age.__getitem__, width)
            if where is None:
                return None
            first, evict = where
            for old in evict:
                plan.release(self._position[old])
                evicted.append(old)
            plan.take(first, self._pages[slot], slot)
            placed.append((slot, first))
        return plan, evicted, placed

    def _apply(self, plan: PageMap, evicted: list[int], placed: list[tuple[int, int]]) -> None:
        """Take a :meth:`_plan`: copy the placed adapters' A into their positions and publish ``h_pos``."""
        if not placed:
            return
        moved = [(s, p) for s, p in placed if self._position.get(s) != p]  # a repack may keep some
        self._map = plan
        changed = {old: -1 for old in evicted}
        for old in evicted:
            del self._position[old]
        for slot, first in placed:
            self._position[slot] = first
            changed[slot] = first
        dst = [m.tail[p : p + self._pages[s]] for s, p in moved for m in self.modules]
        src = [m.slot_pages[s, : self._pages[s]] for s, _ in moved for m in self.modules]
        if dst:
            torch._foreach_copy_(dst, src)
        self.copies += len(moved)
        self._publish(changed)

    def forget(self, slot: int) -> None:
        """The pool rewrote or emptied ``slot``: its staged copy is stale."""
        first = self._position.pop(slot, None)
        if first is not None:
            self._map.release(first)
            self._publish({slot: -1})

    def position_of(self, slot: int) -> int | None:
        return self._position.get(slot)

    def nbytes(self) -> int:
        """GPU memory the positions take: every module's rows past its base weight, and its bias's."""
        total = 0
        for m in self.modules:
            total += m.tail.numel() * m.tail.element_size()
            if m.bias_cat is not None:
                total += (m.bias_cat.numel() - m.out_features) * m.bias_cat.element_size()
        return total

    def width(self, layout: str) -> int:
        """Positions the GEMM of a staged ``layout`` reads."""
        return self.capacity // STAGED_LAYOUTS[layout]

    def reach(self, slots: Iterable[int]) -> int:
        """Positions from the first to the last one held by a staged slot among ``slots``."""
        return max((self._position[s] + self._pages[s] for s in slots if s in self._position), default=0)

    def layout_for(self, slots: Iterable[int]) -> str:
        """The narrowest staged layout whose positions hold every staged slot among ``slots``."""
        reach = self.reach(slots)
        return next(layout for layout in self.layouts if self.width(layout) >= reach)

    def _publish(self, changed: dict[int, int]) -> None:
        # One host-to-device copy of the changed entries (a kernel on the current stream, no sync).
        device = self.h_pos.device
        index = to_device(list(changed), torch.long, device)
        self.h_pos.index_copy_(0, index, to_device(list(changed.values()), torch.int32, device))
