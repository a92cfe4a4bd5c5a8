#!/usr/bin/env bash
# Session 12, call 2 (one H200), under 9.5 minutes, with PDL on by default:
#  1. The issue-13 serving command with the decode microbenchmark (B=32, 128), --sweep-rounds 2.
#  2. Issue 23's rank mixes, two rounds, with what time is left.
# Usage: bash benchmarks/h200_session12_b.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 260 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
  --num-requests 192 --hf-batch 0 --sweep-rounds 2 --micro-batch 32 128 --allow-compiles --out "$out/rounds" \
  > "$out/rounds.log" 2>&1
echo "rounds rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
python benchmarks/scripts/serving_summary.py "$out" rounds > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
left=$((565 - SECONDS))
timeout "$left" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 \
  --num-requests 192 --hf-batch 0 --micro-batch --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 \
  --sweep-rounds 2 --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep -E "ranks" "$out/mixes.log" | grep -v "^ " | sed 's/.*mmlora /mmlora /; s/.*base-only /base-only /' | tail -12
