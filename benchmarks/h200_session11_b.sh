#!/usr/bin/env bash
# Session 11, call 2 (one H200), under 9.5 minutes.
#  1. benchmarks/scripts/upload_host_profile.py: a slot load's host time with the main stream idle and
#     busy (call 1's serving run with the overlap scheduler showed uploads taking 6-17 ms of host time
#     each, against ~2 ms before), and the profiler's view of the busy loads.
#  2. Issue 23's rank mixes with the overlap scheduler: {8}, {16}, {64}, {8,64} in a rank-64 pool,
#     two rounds of [base-only, each mix] in one process.
# Usage: bash benchmarks/h200_session11_b.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 150 python benchmarks/scripts/upload_host_profile.py --out "$out/upload_host.json" > "$out/upload_host.txt" 2>&1
echo "upload profile rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
left=$((560 - SECONDS))
timeout "$left" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 \
  --hf-batch 0 --micro-batch --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 --sweep-rounds 2 \
  --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep -v Warning "$out/upload_host.txt" | head -45
python benchmarks/scripts/serving_summary.py "$out" mixes > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
