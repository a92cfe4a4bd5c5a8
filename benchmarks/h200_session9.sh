#!/usr/bin/env bash
# Session 9, call 2 (one H200): checks and A/Bs for issues 13 and 17. About 8 minutes.
#  1. benchmarks/scripts/nccl_graph_smoke.py: mmlora's all_reduce captured in a CUDA graph through NCCL.
#  2. GPU tests of what changed: decode graphs (tp broadcast path, side stream), the LoRA kernels'
#     two-phase start_lora, the hybrid SGMV path, and the model families against HF + PEFT.
#  3. benchmarks/scripts/lora_overlap_ab.py: decode graphs with the LoRA shrink beside the base GEMM
#     against after it, alternating, in one process.
#  4. benchmarks/scripts/mixed_lora_ab.py: mixed and prefill steps, SGMV against the hybrid dense path.
# Usage: bash benchmarks/h200_session9.sh OUTDIR
# Ran once, at dcf27a5. The hybrid path it measures (4, and tests/kernels/test_dense_segments.py) lost
# and was reverted afterwards, so steps 2 and 4 now miss those files; the results are in
# benchmarks/results/h200-2026-12-02-session9/call2.
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
timeout 60 python benchmarks/scripts/nccl_graph_smoke.py > "$out/nccl_graph_smoke.txt" 2>&1
echo "nccl smoke rc=$?" | tee "$out/rc.txt"
timeout 120 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_cuda_graph.py \
  tests/kernels/test_lora_kernels.py tests/kernels/test_dense_segments.py \
  tests/models/test_llama_family_vs_peft.py > "$out/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" | tee -a "$out/rc.txt"
timeout 180 python benchmarks/scripts/lora_overlap_ab.py --out "$out/overlap_ab.json" > "$out/overlap_ab.txt" 2>&1
echo "overlap ab rc=$?" | tee -a "$out/rc.txt"
timeout 130 python benchmarks/scripts/mixed_lora_ab.py --out "$out/mixed_ab.json" > "$out/mixed_ab.txt" 2>&1
echo "mixed ab rc=$?" | tee -a "$out/rc.txt"
tail -3 "$out/gpu_tests.txt"
cat "$out/nccl_graph_smoke.txt" "$out/overlap_ab.txt"
tail -40 "$out/mixed_ab.txt"
