"""When a decode step takes the shrink stage (:mod:`mmlora.lora.stage`): a tunable rule, kept below the
backends so their tuning tables (:mod:`mmlora.backends.tuning`, ``stage:min_fill``) can name it."""

from __future__ import annotations

#: ``min_fill``: the least share of its layout's positions a decode batch's adapters must take for the step
#: to replay a staged graph (else the backend's usual layout). A staged GEMM reads every position of its
#: layout, the shrink kernels only the batch's adapters: on an H100, B=32 on 32 adapters (all positions
#: used) replayed 0.13 ms faster staged, about what 10 of 32 unused rank-16 positions cost to read, and at
#: 1000 adapters, where a staged batch may fill little more than half its layout, the stage was 0.002 behind
#: (benchmarks/results/h100-2026-12-06-session38). 0 (the default): every batch that fits takes the stage;
#: 0.75 is what the next A/B tries (``stage:min_fill=0.75`` in benchmarks/scripts/with_tuning.py).
SETTINGS: dict[str, float] = {"min_fill": 0.0}


def fills_enough(need: int, width: int) -> bool:
    """Whether adapters taking ``need`` stage positions fill at least ``SETTINGS["min_fill"]`` of a staged
    layout reading ``width`` positions."""
    return need >= SETTINGS["min_fill"] * width
