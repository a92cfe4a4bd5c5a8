#!/usr/bin/env bash
# For the next session (written in session 39 after its device time was spent; not yet run). One call, about
# 380 s. Session 39 (H100, c/) found the stage with min_fill 0.75 ahead at 8 and 32 adapters (+0.031, +0.013 of
# base-only) and 0.003-0.004 behind at 1000, and staged graphs no faster than BGMV's rows where each adapter
# has one row (c/micro). This asks issue 13's command (two rounds), the defaults (serving/) against the
# stage with stage:min_rows_per_adapter=1.5 (knobs/), which sends batches with fewer rows per distinct
# adapter (a 1000-adapter run's tail) to the usual kernels: the stage becomes the default only if no ratio
# falls in either round.
# Usage: bash benchmarks/h200_session39_a.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
knob=stage:min_rows_per_adapter=1.5
extra=(--lora-stage-slots 32)
source "$(dirname "$0")/serving_ab.sh"
grep -ihE "Error|Traceback" "$out"/*.log | head -8
python benchmarks/scripts/serving_summary.py "$out" serving knobs 2>&1 | head -40
true
