#!/usr/bin/env bash
# Session 27: the SGMV GPU tests under run_expand_warps=4 (the new default), then issue 23's slow rank mixes
# {64} and {8, 64} (32 adapters, rank-64 pool), two rounds, each against its own base-only run.
# Usage: bash benchmarks/h200_session27_c.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
date -u > "$out/date.txt"
timeout 150 python -m pytest -q -x -rfE -p no:cacheprovider tests/kernels/test_lora_kernels.py \
  tests/kernels/test_lora_paged.py tests/kernels/test_rank_buckets.py tests/kernels/test_fused_decode.py \
  -k "sgmv or runs or auto or fused" > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
timeout $((570 - SECONDS)) python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 \
  --num-adapters 32 --num-requests 192 --hf-batch 0 --rank-mixes 64 8,64 --pool-rank 64 \
  --sweep-rounds 2 --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR)" "$out/tests.txt" | head -5
grep -iE "Error|Traceback" "$out/mixes.log" | head -5
grep "mmlora \|base-only ranks" "$out/mixes.log" | sed 's/.*run\/s\]//' | cut -c1-200
