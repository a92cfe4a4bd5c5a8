#!/usr/bin/env bash
# Every test file with CUDA-only tests, in one device call: four pytest processes side by side (their Triton
# compiles are CPU work), the slowest groups first (the two slowest took about 240 s each on an H100, session
# 35). Run it after a default changes: session 35 found an fp32 test that session 34's new default broke on
# the GPU alone.
# Usage: bash benchmarks/gpu_tests.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
t() { timeout 330 python -m pytest -q -rfE -p no:cacheprovider "$@"; }
t tests/models/test_llama_family_vs_peft.py tests/models/test_gemma2_vs_peft.py tests/models/test_qwen2_vl_vs_peft.py \
  > "$out/tests_models.txt" 2>&1 &
t tests/kernels/test_cuda_graph.py tests/kernels/test_lora_warmup.py > "$out/tests_graphs.txt" 2>&1 &
t tests/kernels/test_lora_kernels.py tests/kernels/test_mixed_graph.py tests/kernels/test_lora_pdl.py \
  tests/kernels/test_fused_ops.py tests/kernels/test_act_expand.py > "$out/tests_kernels.txt" 2>&1 &
t tests/kernels/test_lora_paged.py tests/kernels/test_rank_buckets.py tests/kernels/test_sgmv_run_knobs.py \
  tests/kernels/test_fused_decode.py tests/kernels/test_lora_side_delta.py tests/kernels/test_attention.py \
  tests/kernels/test_triton_launch.py tests/kernels/test_weight_layout.py tests/kernels/test_lora_check_memo.py \
  tests/kernels/test_lora_stage.py \
  tests/unit/test_host_copy.py tests/unit/test_overlap_schedule.py tests/unit/test_slot_loads_beside.py \
  tests/unit/test_preflight.py tests/unit/test_decode_attention_sweep.py > "$out/tests_rest.txt" 2>&1 &
wait
for f in "$out"/tests_*.txt; do echo "$(basename "$f"): $(tail -1 "$f")"; done | tee "$out/summary.txt"
grep -hE "^(FAILED|ERROR)" "$out"/tests_*.txt | head -20
true
