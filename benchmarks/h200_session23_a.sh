#!/usr/bin/env bash
# Session 23, call 1: the GPU tests that session 22 left unrun (the extended no-compile warm-up test with the
# deferred gate_up path; the fused activation kernel after its review mend, on the device's Triton 3.6) and
# the CUDA-graph tests after runner.cuda_graphs became runner.decode_graphs; then a short serving run at 32
# adapters as a smoke test of the renamed runner in the serving benchmark's breakdown.
# Usage: bash benchmarks/h200_session23_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/gpu.txt" 2>&1
timeout 100 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_act_expand.py > "$out/tests_act.txt" 2>&1
echo "act tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests_act.txt")" | tee "$out/summary.txt"
timeout 280 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_warmup.py tests/kernels/test_cuda_graph.py \
  > "$out/tests_graphs.txt" 2>&1
echo "warm-up + graph tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests_graphs.txt")" | tee -a "$out/summary.txt"
timeout 150 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 96 \
  --hf-batch 0 --micro-batch 32 --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving smoke rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR|E  )" "$out"/tests_*.txt | head -8
grep "mmlora \|base-only\|decode step\|compiles" "$out/serving.log" | sed 's/.*run\/s\]//' | cut -c1-200 | head -8
