#!/usr/bin/env bash
# Session 41, one call of at most about 330 s. Session 41's a/ found the stage's engines with about 2.5 GiB
# less KV cache than its own 1.19 GiB explain (as in session 40's a/), and the manager now hands each
# replaced base weight's memory back while it builds the stage. 1. benchmarks/scripts/stage_memory.py:
# Mistral-7B engines with no stage, the stage, and the stage built the old way, their KV cache against
# the stage's bytes (memory.json); 2. the stage's engine tests on CUDA (tests.txt).
# Usage: bash benchmarks/h200_session41_b.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
echo "python benchmarks/scripts/stage_memory.py OUT/memory.json" >> "$out/command.txt"
timeout 210 python benchmarks/scripts/stage_memory.py "$out/memory.json" > "$out/memory.log" 2>&1
echo "stage_memory rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep '^{' "$out/memory.log"
echo "python -m pytest -q tests/kernels/test_lora_stage_engine.py" >> "$out/command.txt"
timeout $((325 - SECONDS)) python -m pytest -q -p no:cacheprovider tests/kernels/test_lora_stage_engine.py \
  > "$out/tests.txt" 2>&1
echo "stage tests rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
tail -3 "$out/tests.txt"
true
