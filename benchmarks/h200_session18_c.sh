#!/usr/bin/env bash
# Session 18, third H200 call, under 8 minutes, on c1's code plus the upload-plan fix (758bc23) and the
# revert of c2's launch changes (03b781e): 1. the paged-pool and pool GPU tests; 2. issue 23's rank mixes
# in the default pool, two rounds (c1 loaded 32 rank-64 adapters in 211 s; session 17 c3's first-round
# TTFT p50 was 1.42x / 1.65x base-only for {64} / {8,64}).
# Usage: bash benchmarks/h200_session18_c.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 60 python -m pytest -q -p no:cacheprovider tests/kernels/test_lora_paged.py tests/unit/test_pool.py \
  > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
tail -2 "$out/tests.txt"
timeout $((470 - SECONDS)) python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 \
  --num-requests 192 --hf-batch 0 --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 --sweep-rounds 2 \
  --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "mmlora \|base-only ranks\|uploads" "$out/mixes.log" | sed 's/.*run\/s\]//'
