#!/usr/bin/env bash
# Session 22, call 1: gate_up's expand fused into the gated activation (mmlora/backends/triton_sgmv_act.py).
# GPU tests (the fused kernel against fp64 and the unfused path in every dtype; the Llama, Gemma2 and
# Qwen2-VL models against HF + PEFT on CUDA; CUDA graphs and the warm-up, no compile after it), then the
# kernels of one layer's gate_up in both ways, then decode graphs recaptured in both ways.
# Usage: bash benchmarks/h200_session22_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
t() { timeout 250 python -m pytest -q -rfE -p no:cacheprovider "$@"; }
t tests/kernels/test_act_expand.py tests/models/test_llama_family_vs_peft.py tests/models/test_gemma2_vs_peft.py \
  tests/models/test_qwen2_vl_vs_peft.py > "$out/tests_act_models.txt" 2>&1 &
t tests/kernels/test_cuda_graph.py tests/kernels/test_lora_warmup.py > "$out/tests_graphs.txt" 2>&1 &
wait
for f in "$out"/tests_*.txt; do echo "$(basename "$f"): $(tail -1 "$f")"; done | tee "$out/summary.txt"
timeout 90 python benchmarks/scripts/act_expand_kernels.py --rounds 4 --out "$out/act_kernels.json" \
  > "$out/act_kernels.txt" 2>&1
echo "kernels rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((540 - SECONDS)) python benchmarks/scripts/act_expand_ab.py --batch 32 64 128 --rounds 2 \
  --out "$out/graphs_ab.json" > "$out/graphs_ab.txt" 2>&1
echo "graphs rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
cat "$out/act_kernels.txt" "$out/graphs_ab.txt" | grep -v Warning | tail -30
