"""Whether an engine gets a shrink stage (``lora_stage_slots``; :mod:`mmlora.lora.stage`), and building it
over the LoRA wrappers' base weights."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from mmlora.backends.base import LoRABackend
from mmlora.distributed.state import tp_group
from mmlora.forward.device_memory import release_cached_memory
from mmlora.lora.layer import LoRALinear
from mmlora.lora.stage import ShrinkStage

logger = logging.getLogger(__name__)

#: ``lora_stage_slots`` None (auto): the positions a stage gets where it fits. 32 rank-16 adapters of
#: Mistral-7B take 1.19 GiB (issue 13's 32-adapter run on an H100: 0.841x -> 0.853x of base-only, session 42).
STAGE_AUTO_POSITIONS = 32


class StageShape(NamedTuple):
    """The pool's side of a stage: its slot ids (pages), ranks a page (None: unpaged), pages a slot."""

    slot_ids: int
    page_rank: int | None
    pages: int


def build_stage(
    wrappers: Sequence[LoRALinear],
    positions: int | None,
    shape: StageShape,
    backend: LoRABackend,
    device: torch.device,
    stage_fits: Callable[[int], bool] | None,
) -> ShrinkStage | None:
    """``lora_stage_slots``: a stage of that many positions under every wrapper's base weight (each
    wrapper's ``staged`` set), or None: 0, or where it cannot serve (a warning says why). None (auto):
    :data:`STAGE_AUTO_POSITIONS` (at most one a pool page) where ``stage_fits`` their bytes (start-up's
    says so on one CUDA device with decode graphs only, :func:`mmlora.engine.setup._stage_fits`), silently off
    otherwise."""
    if positions == 0:
        return None
    # Any device: decode CUDA graphs use it, and the graph runner's uncaptured path on CPU (tests).
    why = (
        "tensor parallelism" if tp_group().is_parallel
        else "base weights not in row-major layout"
        if not all(w.base.weight.is_contiguous() for w in wrappers)
        else f"the {backend.name} backend has no staged expand"
        if type(backend).add_lora_staged is LoRABackend.add_lora_staged
        else None
    )  # fmt: skip
    if positions is None:
        positions = min(STAGE_AUTO_POSITIONS, shape.slot_ids)
        nbytes = sum(ShrinkStage.module_nbytes(w.base, w.weights, positions) for w in wrappers)
        if why is not None or stage_fits is None or not stage_fits(nbytes):
            logger.info("shrink stage (lora_stage_slots auto): off")
            return None
        logger.info("shrink stage (lora_stage_slots auto): %d positions, %.2f GiB", positions, nbytes / 2**30)
    elif why is not None:
        logger.warning("lora_stage_slots=%d is unused: %s", positions, why)
        return None
    stage = ShrinkStage(positions, shape.slot_ids, device, shape.page_rank, shape.pages)
    release_cached_memory(device)
    for wrapper in wrappers:
        wrapper.staged = stage.add(wrapper.base, wrapper.weights)
        # Each W_cat replaces its base weight: hand the old one's memory back before the next W_cat is
        # allocated, which the caching allocator would otherwise carve out of it, leaving the rest of
        # that segment reserved and lost to the KV cache.
        release_cached_memory(device)
    return stage
