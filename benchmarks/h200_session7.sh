#!/usr/bin/env bash
# Issue 13 / 23, session 7: serving with decode graphs in the runs layout (SGMV over runs of rows on one
# adapter, picked per replay by triton-auto), eager steps ordered by adapter slot, and adapter uploads
# staged in a few page-locked blocks (one host-to-device copy per block). One H200, bf16, dummy
# Mistral-7B, rank 16, one device call.
#  1. GPU tests of the changes (<= 200 s): the pool's staged upload, the Triton backends against
#     HF + PEFT on the GPU (mixed ranks below the pool rank, fewer slots than adapters: staged uploads
#     through both copy paths), graphs in both layouts against eager tokens.
#  2. The issue's command twice: `bench serving` at base-only, 8, 32 and 1000 adapters, 192 requests,
#     default backend, with the decode microbenchmark at B = 32 and 128.
# Usage: bash benchmarks/h200_session7.sh OUTDIR      (about 7 minutes; read OUTDIR/summary.txt)
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout 200 python -m pytest -q -rfE -p no:cacheprovider tests/unit/test_pool.py \
  tests/models/test_llama_family_vs_peft.py tests/kernels/test_cuda_graph.py \
  -k "not triton_attention_matches and not dummy_preset and not mixed_adapter_batch" \
  > "$out/tests.txt" 2>&1
echo "pytest rc=$?" | tee "$out/rc.txt"
for i in 1 2; do
  timeout 150 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
    --num-requests 192 --hf-batch 0 --micro-batch 32 128 --allow-compiles --out "$out/serving$i" \
    > "$out/serving$i.log" 2>&1
  echo "serving$i rc=$?" | tee -a "$out/rc.txt"
done
python benchmarks/scripts/serving_summary.py "$out" serving1 serving2 > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
# 3. Host time of a graph decode step (base-only, B = 128 and 32, context 768): cProfile.
for b in 128 32; do
  timeout 90 python benchmarks/scripts/step_host_profile.py --batch $b > "$out/host_profile_b$b.txt" 2>&1
  echo "host profile B=$b rc=$?" | tee -a "$out/rc.txt"
done
