#!/usr/bin/env bash
# Issue 13 / 23 probes on one H200 (bf16, dummy Mistral-7B), run through the device tool:
#   [tests] the LoRA warm-up no-compile test and the mixed-step kernel tests at real shapes;
#   host (launch) time of one eager LoRA add per backend;
#   the serving run with its breakdown (base-only and 32 adapters of rank 16, 192 requests, decode-step
#   microbenchmark at B=32 and 128);
#   [mixes] the rank-mix sweep of issue 23 (32 adapters of ranks 8, 64, and 8 and 64 alternating).
# Usage: bash benchmarks/h200_perf.sh OUT_DIR [SERVING_SECONDS] [tests] [mixes]
set -u
out=${1:?output folder}
limit=${2:-200}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
if [ "${3:-}" = tests ]; then
  timeout 60 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_lora_warmup.py \
    tests/kernels/test_lora_kernels.py -k "warm or mixed" > "$out/tests.log" 2>&1
  echo "tests rc=$?"
fi
timeout 40 python benchmarks/scripts/lora_host_overhead.py "$out/lora_host_overhead.json" > "$out/host.log" 2>&1
echo "host overhead rc=$?"
timeout "$limit" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 \
  --num-requests 192 --hf-batch 0 --micro-batch 32 128 --allow-compiles --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving rc=$?"
if [ "${4:-}" = mixes ]; then
  timeout 130 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --rank-mixes 8 64 8,64 \
    --num-requests 192 --hf-batch 0 --micro-batch --allow-compiles --out "$out/mixes" > "$out/mixes.log" 2>&1
  echo "mixes rc=$?"
fi
