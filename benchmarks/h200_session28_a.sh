#!/usr/bin/env bash
# For the next session with a GPU (written in session 27 after its device time was spent; not yet run).
# Session 27's profile (h200-2026-12-05-session27/c4) found the decode graphs busy throughout and the LoRA
# cost in 256 short kernels a step. Here: SGMV's shrink as a programmatic dependent of the base GEMM
# (TUNING["shrink_pdl"], opt-in, compiled for sm_90 on CPU only): its GPU tests (the PDL chain against
# plain launches and float64, eager and in graph replays; no compile after the warm-up with it on), then
# its decode-graph A/B at serving's composition (72 rows on 24 adapters, 128 on 32), two rounds. Make it
# the default only if it is faster in both rounds at both sizes with the same tokens; then run issue 13's
# command with it through with_tuning.py (triton-sgmv:shrink_pdl=true).
# Usage: bash benchmarks/h200_session28_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
date -u > "$out/date.txt"
timeout 200 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_pdl.py \
  tests/kernels/test_lora_warmup.py > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
timeout 200 python benchmarks/scripts/shrink_pdl_ab.py --batch 72 --adapters 24 --rounds 2 \
  --out "$out/ab72.json" > "$out/ab72.txt" 2>&1
echo "ab 72 rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((560 - SECONDS)) python benchmarks/scripts/shrink_pdl_ab.py --batch 128 --adapters 32 --rounds 2 \
  --out "$out/ab128.json" > "$out/ab128.txt" 2>&1
echo "ab 128 rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR)" "$out/tests.txt" | head -8
grep -h "^B=" "$out/ab72.txt" "$out/ab128.txt" | cut -c1-300
