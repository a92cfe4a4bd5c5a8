"""Compile every LoRA kernel variant before serving, so no Triton compile lands inside a step.

Triton compiles a kernel per set of compile-time constants (and per class of some integer and pointer
arguments). SGMV and BGMV keep those independent of the batch (its token count, its ranks, its split of
in_features) except for SGMV's few classes of segment length (decode rows, short runs, runs longer than
a token tile), the batch's rank bucket (:func:`mmlora.forward.lora.rank_buckets`: tiles sized for the
ranks in the batch, not the pool's) and, for decode runs, the expand's column-tile group, chosen by the
batch's program count (``LoRABackend.warm_up_variants`` launches the others). So one ``add_lora`` per
module shape, rank bucket and layout class below, and those variants, compile all of them; the
CUDA-graph capture then runs every (batch bucket, rank bound, row layout) a decode step can replay. A
compile costs about a second; inside a serving run it stalled every request in flight (issue 23: rank-8
and mixed-rank runs had 2.6-2.9 s TTFTs).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mmlora.backends.base import LoRABackend
from mmlora.forward import LoRABatchInfo, LoRAWeights, rank_buckets

#: Segment lengths of the warm-up batches: decode rows (BGMV under triton-auto), then one run of
#: each token-tile class of SGMV (up to 16, 32, 64 tokens, and longer: its tile table), and a mixed
#: step (decode rows next to a long chunk).
LAYOUTS: tuple[tuple[int, ...], ...] = ((1, 1), (2,), (17,), (33,), (65,), (1, 1, 65))


def warm_up_lora_kernels(backend: LoRABackend, weights: Iterable[LoRAWeights], max_tokens: int) -> int:
    """Run ``backend.add_lora`` (and ``add_lora_after_base`` where it launches variants of its own) on
    every distinct module shape of ``weights`` (pool views), for each rank bucket of the pool and each
    layout of :data:`LAYOUTS` that fits ``max_tokens``; returns the number of batches so run. Reads slot
    0 of the pool (whatever it holds) and writes only scratch outputs."""
    shapes: dict[tuple, LoRAWeights] = {}
    for w in weights:
        shapes.setdefault((tuple(w.A.shape), tuple(w.B.shape), w.A.dtype, tuple(w.slice_offsets)), w)
    calls = 0
    for w in shapes.values():
        info = LoRABatchInfo(max_tokens, w.A.shape[0], w.A.device, max_lora_rank=w.rank)
        for bucket in rank_buckets(w.rank):
            info.set_slot_rank(0, bucket)  # the batch's rank bound is then this bucket
            for lens in LAYOUTS:
                n_tokens = sum(lens)
                if n_tokens > max_tokens:
                    continue
                info.fill(list(lens), [0] * len(lens))
                x = torch.zeros(n_tokens, w.A.shape[-1], dtype=w.A.dtype, device=w.A.device)
                out = torch.zeros(n_tokens, w.B.shape[-2], dtype=w.A.dtype, device=w.A.device)
                backend.add_lora(out, x, w, info)
                if backend.launches_after_base():
                    backend.add_lora_after_base(out, x, w, info)
                calls += 1 + backend.warm_up_variants(out, x, w, info)
                # gate_up: the expand deferred into its activation (one compile serves both activations)
                pending = backend.defer_lora(x, w, info) if w.gated_pair else None
                if pending is not None:
                    pending.act_and_mul(out, 0)
                    calls += 1
    return calls
