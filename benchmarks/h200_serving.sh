#!/usr/bin/env bash
# Serving benchmarks run through the device tool (one H200, bf16, dummy weights), each under a time limit.
# Usage: bash benchmarks/h200_serving.sh OUT_DIR mistral|rows|sweep|prefix
# --lora-backend triton-bgmv is what the bench's "auto" meant when the committed figures were measured
# (2026-11-30, session 2); "auto" now leaves the choice to the engine: triton-auto (SGMV prefill) on CUDA.
set -u
out=${1:?output folder}
what=${2:?mistral, rows, sweep or prefix}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ "$what" = mistral ]; then
  # Mistral-7B: base-only, 8 / 32 / 128 / 1000 adapters (rank 16, uniform, all at once), the decode-step
  # microbenchmark and HF + PEFT on a subset.
  timeout 560 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 128 1000 \
    --lora-backend triton-bgmv \
    --num-requests 192 --time-budget 420 --out "$out/mistral" > "$out/mistral.log" 2>&1
  echo "mistral rc=$?"
elif [ "$what" = prefix ]; then
  # The prefix cache on against off, Mistral-7B, 32 adapters: each adapter's own 1024-token system prompt
  # with 64-token turns and 128 tokens out; then the standard no-sharing workload, on and off.
  timeout 580 python -m mmlora.bench serving --workload shared-prefix --model dummy:mistral-7b-v0.3 \
    --num-adapters 32 --num-requests 256 --out "$out/prefix" > "$out/prefix.log" 2>&1
  echo "prefix rc=$?"
elif [ "$what" = sweep ]; then
  # The Mistral-7B sweep alone (no decode-step microbenchmark, no HF + PEFT): base-only, 8 / 32 / 128 / 1000.
  timeout 250 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 128 1000 \
    --lora-backend triton-bgmv \
    --num-requests 192 --hf-batch 0 --micro-batch --out "$out/sweep" > "$out/sweep.log" 2>&1
  echo "sweep rc=$?"
else
  # Gemma2-9B and the Qwen2-VL-7B language tower: base-only and 32 adapters, decode step at B=32.
  for model in gemma2-9b qwen2-vl-7b; do
    timeout 165 python -m mmlora.bench serving --model dummy:$model --num-adapters 32 --num-requests 192 \
      --lora-backend triton-bgmv \
      --hf-batch 0 --micro-batch 32 --out "$out/$model" > "$out/$model.log" 2>&1
    echo "$model rc=$?"
  done
fi
