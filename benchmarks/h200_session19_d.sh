#!/usr/bin/env bash
# Session 19, call 4: SGMV's grouped expand for decode runs on by default (run_expand_group=2).
#  1. The GPU tests of the LoRA kernels, paged pools, rank buckets, CUDA graphs and the warm-up with it.
#  2. Issue 13's serving command (8 / 32 / 1000 adapters, the decode micro-benchmark, two rounds).
# Usage: bash benchmarks/h200_session19_d.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 230 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_kernels.py \
  tests/kernels/test_lora_paged.py tests/kernels/test_rank_buckets.py tests/kernels/test_cuda_graph.py \
  tests/kernels/test_lora_warmup.py > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
tail -3 "$out/tests.txt"
timeout 300 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
  --num-requests 192 --hf-batch 0 --micro-batch 32 128 --sweep-rounds 2 --out "$out/serving" \
  > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "mmlora \|base-only\|decode step" "$out/serving.log" | sed 's/.*run\/s\]//' | head -40
