#!/usr/bin/env bash
# Issue 13 / 23, session 7, last call: the serving command twice on the final code (runs-layout
# decode graphs, slot-ordered eager steps, staged uploads with per-slot views), with the decode
# microbenchmark at B = 32 and 128 on 32 adapters (rows share adapters: each captured graph layout,
# rows and runs, replayed on the same batch). One H200, bf16, dummy Mistral-7B, rank 16, one call.
#  1. GPU tests (<= 100 s): the Triton backends against HF + PEFT on the GPU (staged uploads of mixed
#     ranks through both copy paths), the pool.
#  2. `bench serving` at base-only, 8, 32 and 1000 adapters, 192 requests, default backend, twice.
#  3. If time is left, `bench kernels --quick` on qkv and gate_up for bgmv / sgmv / fused.
# Usage: bash benchmarks/h200_session7_final.sh OUTDIR      (about 7 minutes; read OUTDIR/summary.txt)
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout 100 python -m pytest -q -rfE -p no:cacheprovider tests/unit/test_pool.py \
  tests/models/test_llama_family_vs_peft.py -k "triton_backends or pool" > "$out/tests.txt" 2>&1
echo "pytest rc=$?" | tee "$out/rc.txt"
for i in 1 2; do
  limit=$([ "$i" = 1 ] && echo 210 || echo 160)  # the first run after a machine start builds slower
  timeout "$limit" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
    --num-requests 192 --hf-batch 0 --micro-batch 32 128 --micro-adapters 32 --allow-compiles \
    --out "$out/serving$i" > "$out/serving$i.log" 2>&1
  echo "serving$i rc=$?" | tee -a "$out/rc.txt"
done
# 3. If time is left: the LoRA kernels alone on qkv and gate_up (bgmv / sgmv / fused; popularity incl.
#    grouped, rows sorted by adapter as decode graphs order them), to choose the next kernel work.
if [ "$SECONDS" -lt 400 ]; then
  timeout 90 python -m mmlora.bench kernels --quick --ranks 16 --projections qkv gate_up \
    --backends triton-bgmv triton-sgmv triton-fused --out "$out/kernels" > "$out/kernels.log" 2>&1
  echo "kernels rc=$?" | tee -a "$out/rc.txt"
else
  echo "kernels skipped at ${SECONDS} s" | tee -a "$out/rc.txt"
fi
python benchmarks/scripts/serving_summary.py "$out" serving1 serving2 > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
