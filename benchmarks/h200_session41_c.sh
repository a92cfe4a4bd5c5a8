#!/usr/bin/env bash
# Session 41, one call of at most 200 s (what its device time had left). 1. benchmarks/scripts/stage_memory.py:
# Mistral-7B engines without and with the stage, built the old way (the model made in fp32 and then cast, no
# cached memory handed back) and as now, their start-up peak and KV cache (memory.json); 2. the Llama family's
# HF + PEFT test file on CUDA (the model is now made in the serving dtype), stopped with SIGINT at 200 s so
# that a run cut off still prints what ran.
# Usage: bash benchmarks/h200_session41_c.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
rm -f "$out/commit.txt"  # stale; the call returns at most eight files
echo "python benchmarks/scripts/stage_memory.py OUT/memory.json" >> "$out/command.txt"
timeout 110 python benchmarks/scripts/stage_memory.py "$out/memory.json" > "$out/memory.log" 2>&1
echo "stage_memory rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep '^{' "$out/memory.log"
echo "python -m pytest -q -rfE tests/models/test_llama_family_vs_peft.py" >> "$out/command.txt"
timeout -s INT -k 5 $((200 - SECONDS)) python -m pytest -q -rfE -p no:cacheprovider \
  tests/models/test_llama_family_vs_peft.py > "$out/tests_llama.txt" 2>&1
echo "llama tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests_llama.txt")" | tee -a "$out/summary.txt"
true
