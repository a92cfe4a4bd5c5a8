#!/usr/bin/env bash
# GPU checks run through the device tool (one H200): the CUDA-only tests, then the decode-step profile.
# Usage: bash benchmarks/h200_checks.sh OUT_DIR [pytest paths...]
set -u
out=${1:?output folder}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/gpu.txt"
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
  tests=(tests/kernels/test_fused_ops.py tests/kernels/test_cuda_graph.py tests/models/test_gemma2_vs_peft.py
         tests/models/test_qwen2_vl_vs_peft.py tests/models/test_llama_family_vs_peft.py
         tests/kernels/test_lora_kernels.py tests/kernels/test_attention.py)
fi
timeout 400 python -m pytest -q -rfE -p no:cacheprovider "${tests[@]}" > "$out/tests.txt" 2>&1
echo "pytest rc=$?" >> "$out/tests.txt"
tail -3 "$out/tests.txt"
timeout 120 python -m mmlora.bench profile --batch 32 128 --out "$out" > "$out/profile.log" 2>&1
echo "profile rc=$?"
grep -E "^== |^  [a-z]" "$out/profile.log"
