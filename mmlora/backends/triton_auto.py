"""triton-auto: per forward, BGMV for decode-like batches and SGMV for everything else.

Measured on an H200 (bf16, rank 16, Mistral-7B projections, 2026-11-30, ``python -m mmlora.bench
kernels``): with one token per segment (decode) BGMV's split-K gather was faster than SGMV at 1 to
32 tokens (qkv at 32 distinct adapters 17 vs 25 us; down 16 vs 52 us) and about even at 256;
whenever segments are longer (prefill, or decode requests sharing an adapter next to each other)
SGMV won every point (qkv prefill at 4096 tokens 65 vs 660 us). The rule below uses host ints only,
so it needs no device sync; a CUDA graph captured on a decode batch bakes in BGMV, which is right for
any slot mix replayed into the same LoRABatchInfo.
"""

from __future__ import annotations

import torch

from mmlora.backends.base import LoRABackend
from mmlora.backends.registry import register_backend
from mmlora.backends.triton_bgmv import TritonBGMVBackend
from mmlora.backends.triton_sgmv import TritonSGMVBackend
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights


@register_backend("triton-auto")
class TritonAutoBackend(LoRABackend):
    """BGMV when most segments are single tokens (``num_tokens < 2 * num_segments``), else SGMV."""

    def __init__(self) -> None:
        self.bgmv = TritonBGMVBackend()
        self.sgmv = TritonSGMVBackend()

    def pick(self, info: LoRABatchInfo) -> LoRABackend:
        return self.bgmv if info.num_tokens < 2 * info.num_segments else self.sgmv

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> None:
        self.pick(info).add_lora(out, x, weights, info)
