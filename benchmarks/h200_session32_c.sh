#!/usr/bin/env bash
# Session 32, third call: issue 23's slow rank mixes {64} and {8, 64} (32 adapters, rank-64 pool), two
# rounds, each against its own base-only run, as session 27 ran them (h200_session27_c.sh).
# Usage: bash benchmarks/h200_session32_c.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
date -u > "$out/date.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
cmd=(python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192
  --hf-batch 0 --rank-mixes 64 8,64 --pool-rank 64 --sweep-rounds 2)
echo "${cmd[*]}" > "$out/command.txt"
timeout 575 "${cmd[@]}" --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
grep -iE "Error|Traceback" "$out/mixes.log" | head -5
grep "mmlora \|base-only ranks" "$out/mixes.log" | sed 's/.*run\/s\]//' | cut -c1-200
