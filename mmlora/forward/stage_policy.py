"""When a decode step takes the shrink stage (:mod:`mmlora.lora.stage`): a tunable rule, kept below the
backends so their tuning tables (:mod:`mmlora.backends.tuning`, ``stage:min_fill``) can name it."""

from __future__ import annotations

#: ``min_fill``: the least share of its layout's positions a decode batch's adapters must take for the step
#: to replay a staged graph (else the backend's usual layout). A staged GEMM reads every position of its
#: layout, the shrink kernels only the batch's adapters: on an H100, B=32 on 32 adapters (all positions
#: used) replayed 0.13 ms faster staged, about what 10 of 32 unused rank-16 positions cost to read, and at
#: 1000 adapters, where a staged batch may fill little more than half its layout, the stage was 0.002 behind
#: (benchmarks/results/h100-2026-12-06-session38). 0 (the default): every batch that fits takes the stage.
#: With 0.75 the stage was still 0.003-0.004 behind at 1000 adapters (h100-2026-12-06-session39).
#:
#: ``min_rows_per_adapter``: the least mean number of rows per distinct adapter (base rows not counted) for
#: a staged step. A staged GEMM reads each adapter's A once whatever its rows, as SGMV's runs do, while
#: BGMV's rows read it once per row; with one row per adapter a staged graph was no faster than rows on an
#: H100 (B=8: 6.75 ms against 6.71, B=16: 7.62 against 7.39; only a full B=32, 8.53 against 8.69, won:
#: h100-2026-12-06-session39, c/micro), while the serving runs whose batches put about 2 rows and more on
#: each adapter (8 and 32 adapters) gained 0.013-0.031 of base-only. A batch of 1000 adapters' tail (a few
#: requests, all distinct) is what this sends back to rows. With 1.5 (the default) every 1000-adapter decode
#: step took rows, and the stage moved 8 / 32 / 1000 adapters from 0.870 / 0.835 / 0.716 of base-only to
#: 0.895 / 0.850 / 0.716 (h100-2026-12-06-session40/a). 0: no bound.
SETTINGS: dict[str, float] = {"min_fill": 0.0, "min_rows_per_adapter": 1.5}


def worth_staging(rows: int, adapters: int, need: int, width: int) -> bool:
    """Whether a decode step of ``rows`` rows with an adapter over ``adapters`` distinct ones, which take
    ``need`` stage positions in a staged layout reading ``width``, should replay that layout: they fill at
    least ``SETTINGS["min_fill"]`` of it, and put at least ``SETTINGS["min_rows_per_adapter"]`` rows on each
    adapter on average."""
    return need >= SETTINGS["min_fill"] * width and rows >= SETTINGS["min_rows_per_adapter"] * adapters
