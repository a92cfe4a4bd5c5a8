"""LoRALinear: the one wrapper that adds the batch's LoRA deltas to a base linear's output."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mmlora.backends.base import DeferredLoRA, LoRABackend
from mmlora.distributed.state import tp_group
from mmlora.forward.lora import STAGED_LAYOUTS, LoRABatchInfo, LoRAWeights
from mmlora.layers.parallel_linear import RowParallelLinear
from mmlora.lora.stage import ShrinkStage, StagedModule


@dataclass
class LoRAContext:
    """Shared by every LoRALinear of a model: the one channel adapter routing reaches them by.

    Only :class:`~mmlora.lora.manager.LoRAManager` sets ``info``, for the length of one forward."""

    backend: LoRABackend
    info: LoRABatchInfo | None = None
    #: On CUDA (unless disabled): the stream each module's shrink runs on while its base GEMM runs.
    side_stream: torch.cuda.Stream | None = None
    #: Batches of at most this many tokens run the whole LoRA on the side stream, into a buffer the main
    #: stream adds to the base output (``lora_side_max_tokens``); 0: only the shrink goes there.
    side_max_tokens: int = 0
    #: ``cpu_fused_lora``: let the backend run the base GEMM and the LoRA work together
    #: (``LoRABackend.fused_linear``), for base-only batches too.
    fuse_base: bool = False
    #: ``lora_stage_slots``: decode graphs in the ``staged`` layout take the shrink from the base GEMM
    #: (:mod:`mmlora.lora.stage`); the modules' ``staged`` are its views.
    stage: ShrinkStage | None = None


class LoRALinear(nn.Module):
    """``out = base(x); out += lora(x)``: the base layer's own forward, then the backend's batched delta
    (for a row-parallel base: its partial sum, the delta, then the all-reduce).

    ``weights`` are this module's views into the adapter pool (A [S, n*R, in], B [S, out, R],
    scalings [S, n] and the slice offsets of a packed module).
    """

    def __init__(self, base: nn.Linear, weights: LoRAWeights, ctx: LoRAContext) -> None:
        super().__init__()
        self.base = base
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.output_sizes = getattr(base, "output_sizes", (base.out_features,))
        self.weights = weights
        self.ctx = ctx
        # Whether the base may hold a packed copy of its own that a fused call makes redundant.
        self._base_packed = hasattr(base, "release")
        #: This module's [W; A_stage] where the manager stages shrinks (:mod:`mmlora.lora.stage`).
        self.staged: StagedModule | None = None

    def forward_deferred(self, x: torch.Tensor) -> tuple[torch.Tensor, DeferredLoRA | None]:
        """(base output, the LoRA delta still to add) where the backend defers the expand to the reader of
        this output (:meth:`LoRABackend.defer_lora`; a gate_up module's gated activation fuses it), else
        (:meth:`forward`'s output, None). Only a reader that adds the delta may call this. A row-parallel
        base defers only on one process (its delta must otherwise join the partial sum before the
        all-reduce)."""
        info, backend = self.ctx.info, self.ctx.backend
        if (
            info is not None
            and info.has_lora
            and not self.ctx.fuse_base
            and not self._takes_stage(x, info)
            and not (isinstance(self.base, RowParallelLinear) and tp_group().is_parallel)
            and not self._whole_beside(x, info)
        ):
            pending = backend.defer_lora(x.reshape(-1, x.shape[-1]), self.weights, info)
            if pending is not None:
                return self.base(x), pending
        return self(x), None

    def _takes_stage(self, x: torch.Tensor, info: LoRABatchInfo) -> bool:
        """Whether this forward takes its shrink from the base GEMM (a decode graph in a staged layout,
        which the routing picks only where every slot of the batch is staged within its positions)."""
        return (
            self.staged is not None and info.graph_layout in STAGED_LAYOUTS and info.has_lora and x.dim() == 2
        )

    def _whole_beside(self, x: torch.Tensor, info: LoRABatchInfo) -> bool:
        """Whether this batch runs its whole LoRA on the side stream (small decode batches of one row per
        segment: the per-row kernels are latency-bound and small, so all of them run beside the base GEMM,
        into a zeroed buffer, and the critical path gains one elementwise add instead of the expand)."""
        rows = x.numel() // x.shape[-1]
        return (
            self.ctx.side_stream is not None
            and x.is_cuda
            and rows <= self.ctx.side_max_tokens
            and info.num_segments >= rows
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A row-parallel base gives this rank's partial sum; its delta joins it before the all-reduce.
        row_parallel = isinstance(self.base, RowParallelLinear)
        info, side, backend = self.ctx.info, self.ctx.side_stream, self.ctx.backend
        lora = info is not None and info.has_lora
        if self.ctx.fuse_base:
            # cpu_fused_lora: the backend may run the base matmul and the LoRA work together, base-only
            # batches included (torch-gather: one packed [W; A] for the base GEMM and the shrink).
            bias = self.base.partial_bias if row_parallel else self.base.bias
            fused = backend.fused_linear(x, self.base.weight, bias, self.weights, info)
            if fused is not None:
                if self._base_packed:
                    # The backend's stacked copy stands in for the base's own: one packed weight per module.
                    self.base.release()
                    self._base_packed = False
                if not row_parallel:
                    return fused
                return self.base.reduce(fused.contiguous() if tp_group().is_parallel else fused)
            # Declined (its base packs itself again on use): the next fused call frees that copy again.
            self._base_packed = hasattr(self.base, "release")
        if lora and self._takes_stage(x, info):
            out, h = self.staged.linear(x, self.ctx.stage.width(info.graph_layout))
            backend.add_lora_staged(out, h, self.weights, info, self.ctx.stage.h_pos)
            return self.base.reduce(out) if row_parallel else out
        flat_x = x.reshape(-1, x.shape[-1]) if lora else None
        finish = None
        if lora and side is not None and x.is_cuda:
            rows = flat_x.shape[0]
            # Segment kernels beside the GEMM slow it down, so where the whole LoRA does not go there
            # only the shrink, which reads just x, does, and the expand adds to the base output.
            whole = self._whole_beside(x, info)
            if whole or backend.splits_work(info):
                main = torch.cuda.current_stream(x.device)
                # The main stream's buffer (allocated before the fork, read after the join). Partials made
                # on the side are freed before the next module forks again (and that fork waits for this
                # module's join), so no stream reuses them early.
                delta = flat_x.new_empty(rows, self.out_features) if whole else None
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    if whole:
                        delta.zero_()
                        backend.add_lora(delta, flat_x, self.weights, info)
                        finish = lambda out2d: out2d.add_(delta)  # noqa: E731
                    else:
                        finish = backend.start_lora(flat_x, self.weights, info)
        out = self.base.partial(x) if row_parallel else self.base(x)
        if finish is not None:
            main.wait_stream(side)
            finish(out.view(-1, out.shape[-1]))
        elif lora:
            backend.add_lora_after_base(out.view(-1, out.shape[-1]), flat_x, self.weights, info)
        return self.base.reduce(out) if row_parallel else out
