"""The LoRA backend interface: one batched call, ``add_lora(out, x, weights, info)``.

Adapter weights live in the adapter pool as one pair of stacked tensors per (layer, target module):

  A         [num_slots, n_slices * R, in_features]   shrink weights; slice i uses rows i*R : i*R + rank
  B         [num_slots, out_features, R]              expand weights; slice i fills out columns
                                                      slice_offsets[i] : slice_offsets[i + 1]
  scalings  [num_slots, n_slices] float32             alpha / r (or alpha / sqrt(r)) per slot and slice

``R`` is ``max_lora_rank``; an adapter of rank r < R has zero rows/columns past r, so a backend may
either skip them (using ``info.ranks``) or compute them (the result is the same). Packed modules
(q/k/v in ``qkv_proj``, gate/up in ``gate_up_proj``) have several slices; plain modules have one.

Semantics, for every token t with slot s = info.token_slots[t] >= 0 and every slice i:
  h[t, i*R:(i+1)*R]                = x[t] @ A[s, i*R:(i+1)*R].T
  out[t, off[i]:off[i+1]]         += h[t, i*R:(i+1)*R] @ B[s, off[i]:off[i+1]].T * scalings[s, i]
Rows with slot -1 are left untouched. Intermediate ``h`` has the dtype of ``x`` (as PEFT computes it).
How a backend splits the work (shrink then expand, fused, per rank bucket) is its own business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from mmlora.forward.lora import LoRABatchInfo, LoRAWeights


class DeferredLoRA(ABC):
    """One module's LoRA delta whose shrink has run and whose expand waits for the op that reads the
    module's output (:meth:`LoRABackend.defer_lora`): that op may add the delta on the fly instead of the
    expand reading and writing the whole output once more."""

    @abstractmethod
    def apply(self, out: torch.Tensor) -> None:
        """``out [T, out_features] += delta``: the plain expand, for a reader that cannot fuse it."""

    def act_and_mul(self, gate_up: torch.Tensor, act: int) -> torch.Tensor | None:
        """The gated activation of ``gate_up + delta`` ([T, 2I] -> [T, I]; act 0 SiLU, 1 tanh GELU, as
        :mod:`mmlora.layers.fused_ops` numbers them) in one go, or None where this delta cannot (the
        caller then runs :meth:`apply` and its own activation)."""
        return None


class LoRABackend(ABC):
    """A family of batched LoRA kernels. Instances are stateless apart from scratch buffers and host-side
    memos of checks already made."""

    name: ClassVar[str]
    #: How this backend wants a CUDA-graph decode step's rows routed (``LoRABatchInfo.fill_rows``): one
    #: graph is captured per layout listed, and :meth:`graph_layout` picks one per replay.
    graph_layouts: ClassVar[tuple[str, ...]] = ("rows",)
    #: Whether a CUDA graph may hold this backend's launches for any prefill or mixed batch routed by
    #: ``LoRABatchInfo.fill_graph`` (launch shapes from its fixed host ints and tile tables only):
    #: :mod:`mmlora.engine.mixed_graph` replays such steps.
    mixed_graphs: ClassVar[bool] = False

    def graph_layout(self, num_rows: int, num_runs: int) -> str:
        """The layout to replay for a decode step of ``num_rows`` rows forming ``num_runs`` runs of
        adjacent rows on one adapter (padding rows included); one of :attr:`graph_layouts`."""
        return self.graph_layouts[0]

    def graph_segments(self, num_rows: int, layout: str) -> int:
        """Segment entries a ``num_rows``-row graph of ``layout`` is captured with: the most runs a
        replay of it can have (:meth:`graph_layout` decides which replays those are)."""
        return num_rows

    @abstractmethod
    def add_lora(self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> None:
        """``out [T, out] += lora(x [T, in])`` for the batch described by ``info`` (the semantics above);
        a no-op when no row has an adapter."""

    def add_lora_after_base(
        self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo
    ) -> None:
        """:meth:`add_lora`, called right after the kernel that wrote ``out`` (the base GEMM), which did not
        write ``x``: a backend may start its work that reads only ``x`` while that kernel drains. By
        default the plain :meth:`add_lora`."""
        self.add_lora(out, x, weights, info)

    def launches_after_base(self) -> bool:
        """Whether :meth:`add_lora_after_base` launches kernel variants that :meth:`add_lora` does not (the
        warm-up then runs it too). By default it does not."""
        return False

    def fused_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        weights: LoRAWeights,
        info: LoRABatchInfo | None,
    ) -> torch.Tensor | None:
        """``F.linear(x, weight, bias)`` with the batch's LoRA delta added (none where ``info`` is None or
        has no adapter rows), in one go where this backend fuses the base matmul with its LoRA work;
        None where it does not (the layer then runs the base and :meth:`add_lora`). ``weight`` and
        ``bias`` are the base layer's (for a row-parallel shard: its weight shard and the bias this rank
        adds). The result may be a strided view. By default never fused."""
        return None

    def add_lora_staged(
        self,
        out: torch.Tensor,
        h: torch.Tensor,
        weights: LoRAWeights,
        info: LoRABatchInfo,
        h_pos: torch.Tensor,
    ) -> None:
        """The expand alone, ``out [T, out] += delta``, where the shrink came with the base GEMM
        (:mod:`mmlora.lora.stage`): h [T, C * n * R] (any row stride) holds every stage position's shrink
        side by side, and a row on slot s reads the n * R columns from ``h_pos[s] * n * R`` (h_pos [S]
        int32). Backends that list ``staged`` among :attr:`graph_layouts` implement it."""
        raise NotImplementedError(f"{self.name}: no staged expand")

    def start_lora(
        self, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo
    ) -> Callable[[torch.Tensor], None]:
        """``add_lora`` in two phases: the work that reads only ``x`` (the shrink) is launched now, and the
        returned function adds the delta to ``out`` later, so ``start_lora(x, weights, info)(out)`` equals
        ``add_lora(out, x, weights, info)``. The LoRA layer starts on a second CUDA stream while the base
        GEMM runs (both read ``x``) and finishes on the main stream. By default nothing runs early."""
        return lambda out: self.add_lora(out, x, weights, info)

    def defer_lora(self, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> DeferredLoRA | None:
        """The shrink now and the expand handed to the reader of the module's output (a
        :class:`DeferredLoRA`), or None where this backend does not defer for this batch (the layer then
        adds the delta itself). Only asked where the layer's output goes to such a reader (gate_up's, to
        the gated activation). By default never deferred."""
        return None

    def warm_up_variants(
        self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo
    ) -> int:
        """Launch the kernel variants that other batches of this batch's layout class may pick, where the
        choice depends on more than the class (the warm-up, :mod:`mmlora.backends.warmup`, runs one batch a
        class); returns the number of calls made. By default there are none."""
        return 0

    def splits_work(self, info: LoRABatchInfo) -> bool:
        """Whether :meth:`start_lora` launches anything early for this batch (else a second stream
        would have nothing to overlap)."""
        return False
