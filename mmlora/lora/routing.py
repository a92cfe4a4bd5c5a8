"""The per-forward half of :class:`~mmlora.lora.manager.LoRAManager`: routing a forward's tokens to their
adapter slots, for eager forwards (:meth:`ForwardRouting.activate`) and for the CUDA graphs of decode and
mixed steps (``prepare_*``), whose launch shapes and buffers are baked in at capture."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mmlora.config import LoRAConfig
from mmlora.forward.lora import STAGED_LAYOUTS, LoRABatchInfo, rank_buckets, slot_runs
from mmlora.lora.layer import LoRAContext


class ForwardRouting:
    """Mixed into LoRAManager, which owns the state these methods fill: ``info`` (the routing buffers
    every LoRALinear reads), ``_ctx`` (the wrappers' shared context: backend, current info) and
    ``config``."""

    info: LoRABatchInfo
    _ctx: LoRAContext
    config: LoRAConfig

    @contextlib.contextmanager
    def activate(self, seq_lens: list[int], seq_slots: list[int]) -> Iterator[LoRABatchInfo]:
        """An eager forward: route per-request token counts to their slots (-1 = base)."""
        self.info.fill(seq_lens, seq_slots)
        with self.prepared() as info:
            yield info

    @property
    def rank_buckets(self) -> tuple[int, ...]:
        """The rank bounds a batch can have (:func:`mmlora.forward.lora.rank_buckets`): decode graphs are
        captured per (batch bucket, rank bound, layout), and bound 0 is the graph without LoRA."""
        return rank_buckets(self.config.max_lora_rank)

    @property
    def graph_layouts(self) -> tuple[str, ...]:
        """The row layouts the backend's decode graphs are captured in (``LoRABackend.graph_layouts``), and
        the stage's (``staged`` and its narrower prefixes) where shrinks are staged (:mod:`mmlora.lora.stage`)."""
        layouts, stage = self._ctx.backend.graph_layouts, self._ctx.stage
        return (*layouts, *stage.layouts) if stage is not None else layouts

    def prepare_capture(self, rows: int, rank_bound: int, layout: str = "rows") -> None:
        """Before capturing a ``rows``-row decode graph: every row base-only, and the host ints the graph
        bakes in (the LoRA kernels' launch shapes cover ranks up to ``rank_bound``, one of
        :attr:`rank_buckets`, 0: the graph without LoRA; and segments in ``layout``, one of
        :attr:`graph_layouts`)."""
        segments = self._ctx.backend.graph_segments(rows, _segment_layout(layout))
        self.info.fill_rows([-1] * rows, rank_bound, layout, segments)

    def prepare_replay(self, row_slots: list[int], layout: str | None = None) -> tuple[int, str]:
        """Before replaying a graph captured by :meth:`prepare_capture`: each row's slot (-1 = base or
        padding), written into the captured buffers. Returns the rank bound (the bucket of the rows'
        largest rank; 0 when no row has an adapter) and the layout of the graph to replay: the backend's
        pick, or ``layout`` when given (a benchmark timing each; a ValueError if these rows' runs do not
        fit its graph)."""
        backend, stage = self._ctx.backend, self._ctx.stage
        bound = self.info.bound_of(row_slots)
        layouts = self.graph_layouts
        staged = stage is not None
        runs = slot_runs(row_slots) if bound and ("runs" in layouts or staged) else None
        if layout is None:
            if bound == 0:
                layout = "rows"
            elif (
                staged
                and len(runs) <= backend.graph_segments(len(row_slots), "staged")
                and stage.ensure(row_slots, when_worth=True)
            ):
                layout = stage.layout_for(row_slots)  # every slot of the batch is staged now
            elif len(layouts) == 1:
                layout = layouts[0]
            else:
                layout = backend.graph_layout(len(row_slots), len(runs))
        elif layout in STAGED_LAYOUTS and not (
            staged and stage.ensure(row_slots) and stage.reach(row_slots) <= stage.width(layout)
        ):
            raise ValueError(
                f"prepare_replay: these rows' adapters do not fit the {layout} stage positions "
                f"({stage and stage.capacity} in all)"
            )
        segments = backend.graph_segments(len(row_slots), _segment_layout(layout))
        self.info.fill_rows(row_slots, bound, layout, segments, runs)
        return bound, layout

    def prepare_mixed(
        self, seq_lens: list[int], seq_slots: list[int], num_tokens: int, num_segments: int
    ) -> int:
        """Before a mixed-step graph's replay (:mod:`mmlora.engine.mixed_graph`): per-request token counts
        and slots (-1 = base) routed into a bucket of ``num_tokens`` tokens and ``num_segments`` segment
        entries (``LoRABatchInfo.fill_graph``). Returns the rank bound of the graph to replay."""
        bound = self.info.bound_of(seq_slots)
        self.info.fill_graph(seq_lens, seq_slots, num_tokens, num_segments, bound)
        return bound

    def prepare_mixed_capture(self, num_tokens: int, num_segments: int, rank_bound: int) -> None:
        """Before capturing a mixed-step graph: no request, every row padding, launches shaped for
        ``rank_bound`` (one of 0 and :attr:`rank_buckets`)."""
        self.info.fill_graph([], [], num_tokens, num_segments, rank_bound)

    @contextlib.contextmanager
    def prepared(self) -> Iterator[LoRABatchInfo]:
        """A forward over the routing last filled (by activate, prepare_capture or prepare_replay)."""
        if self._ctx.info is not None:
            raise RuntimeError("nested LoRA forwards are not allowed")
        self._ctx.info = self.info
        try:
            yield self.info
        finally:
            self._ctx.info = None


def _segment_layout(layout: str) -> str:
    """The layout a backend sizes a graph's segment entries by: every staged layout is ``staged``."""
    return "staged" if layout in STAGED_LAYOUTS else layout
