#!/usr/bin/env bash
# Session 20, call 2: issue 13's serving command (8 / 32 / 1000 adapters, the decode micro-benchmark, two
# rounds) and issue 23's rank mixes (32 adapters, default rank-64 pool paged by 16, two rounds), both on the
# grouped expand default (5a419e3) and its shared h reader (537dded).
# Usage: bash benchmarks/h200_session20_b.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 200 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
  --num-requests 192 --hf-batch 0 --micro-batch 32 128 --sweep-rounds 2 --out "$out/serving" \
  > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
timeout $((530 - SECONDS)) python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 \
  --num-requests 192 --hf-batch 0 --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 --sweep-rounds 2 \
  --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
for f in serving mixes; do grep "mmlora \|base-only ranks\|decode step" "$out/$f.log" | sed 's/.*run\/s\]//' | cut -c1-260; done
