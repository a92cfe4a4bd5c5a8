#!/usr/bin/env bash
# Session 36, one call (about 560 s), on an H200 if one comes:
# 1. the staged shrink's CUDA tests (tests/kernels/test_lora_stage.py: captured decode graphs against eager);
# 2. issue 13's serving command (default backend, 8 / 32 / 1000 adapters, decode micro-benchmark, two sweep
#    rounds) with the defaults, then with --lora-stage-slots 32 (the decode shrink from the base GEMM), then
#    with the step inputs page-locked (host-copy:pinned=true), each with a third of what is left;
# 3. if time is left, shrink_in_gemm_probe.py (cuBLAS with the stage's rows, and the shrink alone).
# Usage: [BUDGET=seconds] [ADAPTERS="8 32"] bash benchmarks/h200_session36_b.sh OUTDIR   (BUDGET: the call's limit less 10, 590)
source "$(dirname "$0")/device_preamble.sh" "$@"
budget=${BUDGET:-590}
timeout 120 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_stage.py > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
# ADAPTERS: the adapter counts (default issue 13's 8 32 1000; a short call may leave out 1000).
# shellcheck disable=SC2206
args=(serving --model dummy:mistral-7b-v0.3 --num-adapters ${ADAPTERS:-8 32 1000} --num-requests 192 --hf-batch 0
  --micro-batch 32 128 --sweep-rounds 2)
{
  echo "python -m mmlora.bench ${args[*]}"
  echo "python -m mmlora.bench ${args[*]} --lora-stage-slots 32"
  echo "python benchmarks/scripts/with_tuning.py host-copy:pinned=true -- ${args[*]}"
} > "$out/command.txt"
runs=3
((budget < 500)) && runs=2  # too short for three: the pinned inputs wait
timeout $(((budget - SECONDS) / runs)) python -m mmlora.bench "${args[@]}" --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $(((budget - SECONDS) / (runs - 1))) python -m mmlora.bench "${args[@]}" --lora-stage-slots 32 --out "$out/staged" \
  > "$out/staged.log" 2>&1
echo "serving staged rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
if ((runs == 3)); then
  timeout $((budget - 15 - SECONDS)) python benchmarks/scripts/with_tuning.py host-copy:pinned=true -- "${args[@]}" \
    --out "$out/pinned" > "$out/pinned.log" 2>&1
  echo "serving pinned rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
fi
left=$((budget - 5 - SECONDS))
if ((left > 20)); then
  timeout $left python benchmarks/scripts/shrink_in_gemm_probe.py --batches 72 128 --slots 24 32 --ranks 16 \
    --out "$out/gemm_probe.json" > "$out/gemm_probe.txt" 2>&1
  echo "gemm probe rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
fi
grep -ihE "Error|Traceback" "$out"/*.txt "$out"/*.log | head -8
python benchmarks/scripts/serving_summary.py "$out" serving staged pinned 2>&1 | head -70
python benchmarks/scripts/launch_by_uploads.py "$out/serving/serving.json" "$out/pinned/serving.json" 2>&1 | tail -12
cat "$out/gemm_probe.txt" 2>/dev/null
true
