#!/usr/bin/env bash
# Every test file with CUDA-only tests, in two device calls (part 1, then part 2): since session 39 the files
# take more than one call's 600 s even side by side (t/ and u/ of h100-2026-12-06-session39). Each part runs
# its groups as pytest processes side by side (their Triton compiles are CPU work), stopped with SIGINT at
# 560 s so that a group cut off still prints its failures. Run it after a default changes: session 35 found
# an fp32 test that session 34's new default broke on the GPU alone.
# Usage: bash benchmarks/gpu_tests.sh OUTDIR 1|2
source "$(dirname "$0")/device_preamble.sh" "$@"
part=${2:?part 1 or 2}
# GPU_TESTS_TIMEOUT: a call that runs something else first gives the groups less than 560 s.
t() { timeout -s INT -k 20 "${GPU_TESTS_TIMEOUT:-560}" python -m pytest -q -rfE -p no:cacheprovider "$@"; }
case $part in
1)
  t tests/models/test_llama_family_vs_peft.py > "$out/tests_llama.txt" 2>&1 &
  t tests/models/test_gemma2_vs_peft.py > "$out/tests_gemma2.txt" 2>&1 &
  t tests/models/test_qwen2_vl_vs_peft.py > "$out/tests_qwen2_vl.txt" 2>&1 &
  t tests/kernels/test_cuda_graph.py > "$out/tests_graphs.txt" 2>&1 &
  t tests/kernels/test_lora_warmup.py tests/kernels/test_lora_stage.py tests/kernels/test_lora_stage_engine.py \
    > "$out/tests_warmup_stage.txt" 2>&1 &
  ;;
2)
  t tests/kernels/test_lora_kernels.py > "$out/tests_kernels.txt" 2>&1 &
  t tests/kernels/test_mixed_graph.py tests/kernels/test_lora_pdl.py tests/kernels/test_fused_ops.py \
    tests/kernels/test_act_expand.py > "$out/tests_graph_kernels.txt" 2>&1 &
  t tests/kernels/test_lora_paged.py tests/kernels/test_rank_buckets.py tests/kernels/test_sgmv_run_knobs.py \
    tests/kernels/test_fused_decode.py tests/kernels/test_lora_side_delta.py tests/kernels/test_attention.py \
    > "$out/tests_paged.txt" 2>&1 &
  t tests/kernels/test_triton_launch.py tests/kernels/test_weight_layout.py tests/kernels/test_lora_check_memo.py \
    tests/unit/test_host_copy.py tests/unit/test_overlap_schedule.py tests/unit/test_slot_loads_beside.py \
    tests/unit/test_preflight.py tests/unit/test_decode_attention_sweep.py > "$out/tests_rest.txt" 2>&1 &
  ;;
*) echo "part must be 1 or 2, got $part" >&2; exit 2 ;;
esac
# Who holds the card's memory (session 40's part 1 failed 20 tests for want of it): each process's use every
# 3 s, and which test group each pytest process runs.
(while sleep 3; do
  echo "# $SECONDS s"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
done) > "$out/gpu_memory.txt" 2>&1 &
monitor=$!
sleep 5; ps -eo pid,args | grep "[p]ytest" | cut -c1-200 > "$out/pids.txt"
wait $(jobs -p | grep -v "^$monitor$")
kill $monitor
for f in "$out"/tests_*.txt; do echo "$(basename "$f"): $(tail -1 "$f")"; done | tee "$out/summary.txt"
grep -hE "^(FAILED|ERROR)" "$out"/tests_*.txt | head -20
true
