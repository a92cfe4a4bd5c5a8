#!/usr/bin/env bash
# Session 14, call 4 (one H200), under 7 minutes: session 13's kernels back (call 3's BGMV change was slower).
#  1. tests/kernels/test_lora_pdl.py, with the new NaN-poisoned-scratch test: does any expand read its
#     shrink's partials before the shrink wrote them (PDL race)?
#  2. Issue 23: serving with rank mixes {8}, {16}, {64}, {8,64} in a rank-64 pool, 32 adapters, two rounds
#     (the command of benchmarks/h200_ranks.sh, step 2), not re-measured since session 12.
# Usage: bash benchmarks/h200_session14_d.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 60 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_pdl.py > "$out/tests_pdl.txt" 2>&1
echo "pdl tests rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
tail -4 "$out/tests_pdl.txt"
timeout 300 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 \
  --hf-batch 0 --micro-batch --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 --sweep-rounds 2 \
  --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
python benchmarks/scripts/serving_summary.py "$out" mixes > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
