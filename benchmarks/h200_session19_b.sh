#!/usr/bin/env bash
# Prepared in session 18 (not yet run on a GPU): issue 13's serving command, 8 / 32 / 1000 adapters with the
# decode micro-benchmark, two rounds, on the default pool (paged by 16 since 62cea95; no done-when run has
# used it yet). Under 9.5 minutes; the JSON is written as the run goes.
# Usage: bash benchmarks/h200_session19_b.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 570 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
  --num-requests 192 --hf-batch 0 --micro-batch 32 128 --sweep-rounds 2 --out "$out/serving" \
  > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
grep "mmlora \|base-only\|decode step\|replay" "$out/serving.log" | sed 's/.*run\/s\]//' | head -40
