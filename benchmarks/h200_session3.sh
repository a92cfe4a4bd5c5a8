#!/usr/bin/env bash
# Session 3 (2026-12-01) H200 runs, two device calls on one warm machine (bf16, dummy weights).
#   call 1: bash benchmarks/h200_session3.sh OUT checks   CUDA tests, decode-step profile, serving run 1
#   call 2: bash benchmarks/h200_session3.sh OUT serving  serving run 2, prefix cache on/off, rank mixes
# Serving: Mistral-7B dummy, 192 requests, base-only then 8 / 32 / 1000 rank-16 adapters (default
# backend), decode-step microbenchmark at B=32 and 128. Each run's JSON carries the step breakdown.
set -u
out=${1:?output folder}
what=${2:?checks or serving}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
serving() {  # serving run N
  timeout 150 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
    --num-requests 192 --hf-batch 0 --micro-batch 32 128 --allow-compiles --out "$out/serving$1" \
    > "$out/serving$1.log" 2>&1
  echo "serving$1 rc=$?"
  grep -E "out tok/s|x floor|over floor|compiles" "$out/serving$1.log" | tail -12
}
if [ "$what" = checks ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/gpu.txt"
  timeout 240 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_cuda_graph.py \
    tests/kernels/test_fused_ops.py tests/kernels/test_lora_kernels.py tests/kernels/test_lora_warmup.py \
    tests/kernels/test_fused_decode.py tests/models/test_llama_family_vs_peft.py \
    tests/models/test_gemma2_vs_peft.py tests/models/test_qwen2_vl_vs_peft.py tests/kernels/test_attention.py \
    > "$out/tests.txt" 2>&1
  echo "pytest rc=$?" | tee -a "$out/tests.txt"
  tail -4 "$out/tests.txt"
  timeout 90 python -m mmlora.bench profile --batch 32 128 --out "$out/profile" > "$out/profile.log" 2>&1
  echo "profile rc=$?"
  grep -E "^== |^  [a-z]" "$out/profile.log" | head -30
  serving 1
else
  # the HF + PEFT model tests that call 1's 240 s did not reach
  timeout 110 python -m pytest -q -rfE -p no:cacheprovider tests/models/test_llama_family_vs_peft.py \
    tests/models/test_gemma2_vs_peft.py tests/models/test_qwen2_vl_vs_peft.py > "$out/tests_models.txt" 2>&1
  echo "pytest models rc=$?" | tee -a "$out/tests_models.txt"
  tail -3 "$out/tests_models.txt"
  serving 2
  timeout 150 python -m mmlora.bench serving --workload shared-prefix --model dummy:mistral-7b-v0.3 \
    --num-adapters 32 --num-requests 96 --out "$out/prefix" > "$out/prefix.log" 2>&1
  echo "prefix rc=$?"
  tail -8 "$out/prefix.log"
  timeout 120 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 \
    --rank-mixes 8 64 8,64 --num-requests 192 --hf-batch 0 --micro-batch --allow-compiles \
    --out "$out/mixes" > "$out/mixes.log" 2>&1
  echo "mixes rc=$?"
  grep -E "out tok/s|padding" "$out/mixes.log" | tail -10
fi
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
