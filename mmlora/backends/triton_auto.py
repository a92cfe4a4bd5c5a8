"""triton-auto: per forward, BGMV for decode-like batches and SGMV for everything else.

Measured on an H200 (bf16, rank 16, Mistral-7B projections, 2026-11-30, ``python -m mmlora.bench
kernels``): with one token per segment (decode) BGMV's split-K gather was faster than SGMV at 1 to
32 tokens (qkv at 32 distinct adapters 17 vs 25 us; down 16 vs 52 us) and about even at 256;
whenever segments are longer (prefill, or decode requests sharing an adapter next to each other)
SGMV won every point (qkv prefill at 4096 tokens 65 vs 660 us). The rule below uses host ints only,
so it needs no device sync.

CUDA graphs: decode graphs are captured in both layouts of ``LoRABatchInfo.fill_rows``, BGMV over
``rows`` and SGMV over ``runs``, and each replay picks by the same rule on its rows and runs: a batch
of 128 rows on 32 adapters (runs of about 4 rows) reads each adapter once per run with SGMV instead of
once per row with BGMV.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmlora.backends.base import DeferredLoRA, LoRABackend
from mmlora.backends.registry import register_backend
from mmlora.backends.triton_bgmv import TritonBGMVBackend
from mmlora.backends.triton_sgmv import TritonSGMVBackend
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights

#: ``staged_segments``: the segment entries of a ``staged`` decode graph (:mod:`mmlora.lora.stage`): "rows",
#: one per row (every batch whose adapters fit the stage takes it, its expand launching up to twice the
#: programs of "half", the unused ones returning at once), or "half" of the rows as for ``runs`` (a batch with
#: more runs replays BGMV's ``rows`` graph instead). H200, session 37 (benchmarks/results/
#: h200-2026-12-06-session37): one B=32 batch on 32 adapters replayed in 6.81 ms staged against 6.99 ms in
#: BGMV's rows, and with "rows" every LoRA decode step of issue 13's 8 and 32 adapters took the stage, where
#: "half" had left 169 of 602 steps of issue 23's mix to BGMV. The two were not timed against each other on
#: a batch that fits both.
TUNING = {"staged_segments": "rows"}


@register_backend("triton-auto")
class TritonAutoBackend(LoRABackend):
    """BGMV when most segments are single tokens (``num_tokens < 2 * num_segments``), else SGMV."""

    graph_layouts = ("rows", "runs")
    # A mixed-step graph has num_tokens >= 2 * num_segments (MixedGraphRunner.segments): SGMV's.
    mixed_graphs = True

    def __init__(self) -> None:
        self.bgmv = TritonBGMVBackend()
        self.sgmv = TritonSGMVBackend()

    @staticmethod
    def segment_kernel_pays(num_tokens: int, num_segments: int) -> bool:
        return num_tokens >= 2 * num_segments

    def graph_layout(self, num_rows: int, num_runs: int) -> str:
        return "runs" if self.segment_kernel_pays(num_rows, num_runs) else "rows"

    def graph_segments(self, num_rows: int, layout: str) -> int:
        # Runs are replayed only when num_rows >= 2 * num_runs: half the entries (and SGMV programs).
        if layout == "runs" or (layout == "staged" and TUNING["staged_segments"] == "half"):
            return max(1, num_rows // 2)
        return num_rows

    def pick(self, info: LoRABatchInfo) -> LoRABackend:
        if info.graph_layout is not None:
            return self.bgmv if info.graph_layout == "rows" else self.sgmv
        return self.sgmv if self.segment_kernel_pays(info.num_tokens, info.num_segments) else self.bgmv

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> None:
        self.pick(info).add_lora(out, x, weights, info)

    def add_lora_after_base(
        self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo
    ) -> None:
        self.pick(info).add_lora_after_base(out, x, weights, info)

    def launches_after_base(self) -> bool:
        return self.bgmv.launches_after_base() or self.sgmv.launches_after_base()

    def splits_work(self, info: LoRABatchInfo) -> bool:
        return self.pick(info).splits_work(info)

    def defer_lora(self, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> DeferredLoRA | None:
        return self.pick(info).defer_lora(x, weights, info)

    def warm_up_variants(
        self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo
    ) -> int:
        return self.pick(info).warm_up_variants(out, x, weights, info)

    def add_lora_staged(
        self,
        out: torch.Tensor,
        h: torch.Tensor,
        weights: LoRAWeights,
        info: LoRABatchInfo,
        h_pos: torch.Tensor,
    ) -> None:
        self.sgmv.add_lora_staged(out, h, weights, info, h_pos)

    def start_lora(
        self, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo
    ) -> Callable[[torch.Tensor], None]:
        return self.pick(info).start_lora(x, weights, info)
