#!/usr/bin/env bash
# After benchmarks/h200_buckets.sh: should a rank-64 pool (the default max_lora_rank) be paged by 16 by
# default on CUDA? Serving 32 rank-16 adapters, two rounds each, in a rank-16 pool, a rank-64 pool and a
# rank-64 pool paged by 16 (each against its own base-only runs), under 8 minutes. Page by default only
# if the paged pool serves within the noise of the rank-16 pool and ahead of the unpaged one.
# Usage: bash benchmarks/h200_buckets_b.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
S="python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --allow-compiles --rank-mixes 16 --sweep-rounds 2"
timeout 150 $S --pool-rank 16 --out "$out/pool16" > "$out/pool16.log" 2>&1
echo "pool16 rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
timeout 150 $S --pool-rank 64 --out "$out/pool64" > "$out/pool64.log" 2>&1
echo "pool64 rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
timeout $((470 - SECONDS)) $S --pool-rank 64 --lora-page-rank 16 --out "$out/pool64_paged" > "$out/pool64_paged.log" 2>&1
echo "pool64_paged rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
for f in pool16 pool64 pool64_paged; do echo "-- $f"; grep "mmlora \|base-only ranks" "$out/$f.log" | sed 's/.*run\/s\]//'; done
