#!/usr/bin/env bash
# For the next session (written in session 40 after its device time was spent; not yet run). One call, about
# 500 s: issue 23's rank mixes {64} and {8, 64}, defaults (serving/) against --lora-stage-slots 32 with
# stage:min_rows_per_adapter=1.5 (knobs/), the stage arm that session 40's issue 13 A/B left level or ahead
# at every adapter count (h100-2026-12-06-session40/a). With 32 positions a rank-64 adapter takes four, so
# a batch of 32 rank-64 adapters does not fit the stage, and only the KV cache's 1.2 GB should differ. The
# stage becomes the CUDA default only if neither mix falls in either round; then run gpu_tests.sh 1 and 2.
# Usage: bash benchmarks/h200_session40_a.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
knob=stage:min_rows_per_adapter=1.5
extra=(--lora-stage-slots 32)
args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --pool-rank 64
  --rank-mixes 64 8,64 --sweep-rounds 2)
source "$(dirname "$0")/serving_ab.sh"
grep -ihE "Error|Traceback" "$out"/*.log | head -8
python benchmarks/scripts/serving_summary.py "$out" serving knobs 2>&1 | head -40
true
