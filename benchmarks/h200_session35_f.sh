#!/usr/bin/env bash
# Session 35 (about 330 s): the GPU tests touched by expand_dependents becoming a default (the fused ops
# after a decode-run expand launched as its programmatic dependents): every model family against HF + PEFT,
# the decode and mixed-step CUDA graphs, the fused ops and the PDL chains, in three pytest processes side by
# side (their Triton compiles are CPU work).
# Usage: bash benchmarks/h200_session35_f.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
t() { timeout 320 python -m pytest -q -rfE -p no:cacheprovider "$@"; }
t tests/models/test_llama_family_vs_peft.py tests/models/test_gemma2_vs_peft.py tests/models/test_qwen2_vl_vs_peft.py \
  > "$out/tests_models.txt" 2>&1 &
t tests/kernels/test_cuda_graph.py tests/kernels/test_lora_warmup.py > "$out/tests_graphs.txt" 2>&1 &
t tests/kernels/test_mixed_graph.py tests/kernels/test_lora_pdl.py tests/kernels/test_fused_ops.py \
  tests/kernels/test_act_expand.py > "$out/tests_mixed_pdl.txt" 2>&1 &
wait
for f in "$out"/tests_*.txt; do echo "$(basename "$f"): $(tail -1 "$f")"; done | tee "$out/summary.txt"
grep -hE "^(FAILED|ERROR)" "$out"/tests_*.txt | head -12
true
