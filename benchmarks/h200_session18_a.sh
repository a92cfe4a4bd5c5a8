#!/usr/bin/env bash
# Session 18, first H200 call, under 9.5 minutes:
#  1. Where an eager mixed step's host time goes now (fast Triton launches since session 8's profile):
#     128 decode rows + one 512-token chunk per step, 32 rank-16 adapters and base-only; cProfile and
#     torch.profiler tables (serving: lora_host about 97 us an add_lora call, session 17 c2).
#  2. benchmarks/h200_uploads.sh: the upload plans of eceeff9 / ea7549b against the old ones (ab_old/),
#     then issue 23's rank mixes in the default pool, two rounds.
# Usage: bash benchmarks/h200_session18_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash benchmarks/h200_mixed_profiles.sh "$out"
BUDGET=$((570 - SECONDS)) bash benchmarks/h200_uploads.sh "$out/uploads"
