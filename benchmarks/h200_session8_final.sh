#!/usr/bin/env bash
# Session 8, issue 13: the retuned Triton launch heuristics (BGMV: one expand warp, two shrink warps;
# SGMV: 32-token shrink tiles, 2 waves, 2 warps for 16-token expand tiles; from
# benchmarks/scripts/lora_tuning_sweep.py) in the serving command, twice, with the decode
# microbenchmark. One H200, bf16, dummy Mistral-7B, rank 16, one call of about 9 minutes.
#  1. GPU tests (<= 150 s): the SGMV/BGMV kernels against their references on CUDA, the Triton backends
#     against HF + PEFT, the pool, the CUDA-graph tests.
#  2. `bench serving` at base-only, 8, 32 and 1000 adapters, 192 requests, default backend, twice.
# Usage: bash benchmarks/h200_session8_final.sh OUTDIR      (read OUTDIR/summary.txt)
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout 150 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_kernels.py \
  tests/kernels/test_cuda_graph.py tests/unit/test_pool.py tests/models/test_llama_family_vs_peft.py \
  -k "sgmv or bgmv or triton or graph or pool" > "$out/tests.txt" 2>&1
echo "pytest rc=$?" | tee "$out/rc.txt"
for i in 1 2; do
  limit=$([ "$i" = 1 ] && echo 210 || echo 170)  # the first run after a machine start builds slower
  timeout "$limit" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
    --num-requests 192 --hf-batch 0 --micro-batch 32 128 --micro-adapters 32 --allow-compiles \
    --out "$out/serving$i" > "$out/serving$i.log" 2>&1
  echo "serving$i rc=$?" | tee -a "$out/rc.txt"
done
python benchmarks/scripts/serving_summary.py "$out" serving1 serving2 > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
