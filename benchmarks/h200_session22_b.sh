#!/usr/bin/env bash
# Session 22, call 2: the fused activation with column groups and unrolled h planes (after call 1 found the
# first version 1.03-1.58x slower than the expand and the activation it fuses). Its tests first (stopping at
# the first failure, long tracebacks), then one layer's gate_up both ways, the models against HF + PEFT on
# CUDA, and decode graphs recaptured both ways.
# Usage: bash benchmarks/h200_session22_b.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 100 python -m pytest -q -x -rfE -p no:cacheprovider tests/kernels/test_act_expand.py > "$out/tests_act.txt" 2>&1
echo "act tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests_act.txt")" | tee "$out/summary.txt"
timeout 90 python benchmarks/scripts/act_expand_kernels.py --rounds 4 --out "$out/act_kernels.json" \
  > "$out/act_kernels.txt" 2>&1
echo "kernels rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout 170 python -m pytest -q -rfE -p no:cacheprovider tests/models/test_llama_family_vs_peft.py \
  tests/models/test_gemma2_vs_peft.py tests/models/test_qwen2_vl_vs_peft.py > "$out/tests_models.txt" 2>&1
echo "model tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests_models.txt")" | tee -a "$out/summary.txt"
timeout $((550 - SECONDS)) python benchmarks/scripts/act_expand_ab.py --batch 64 128 --rounds 2 \
  --out "$out/graphs_ab.json" > "$out/graphs_ab.txt" 2>&1
echo "graphs rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -E "^(FAILED|E  )" "$out/tests_act.txt" | head -20
cat "$out/act_kernels.txt" | grep -v Warning | tail -6
grep "B=" "$out/graphs_ab.txt" | grep -v adapters
