#!/usr/bin/env bash
# Session 15, call 3 (one H200), under 6 minutes, issue 23, on the defaults of 78ecaeb: serving with rank
# mixes {8}, {16}, {64}, {8,64} in a rank-64 pool, 32 adapters, two rounds (benchmarks/h200_ranks.sh, step 2).
# Usage: bash benchmarks/h200_session15_c.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 330 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 \
  --hf-batch 0 --micro-batch --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 --sweep-rounds 2 \
  --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
python benchmarks/scripts/serving_summary.py "$out" mixes > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
