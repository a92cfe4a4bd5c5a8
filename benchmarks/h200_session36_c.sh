#!/usr/bin/env bash
# Session 36, a short call (what little device time is left): the staged shrink's captured-graph tests, then
# one serving command with --lora-stage-slots 32 whose decode micro-benchmark replays the same batch's
# graphs in each layout side by side (rows: BGMV, runs: SGMV, staged: the shrink from the base GEMM), at
# B=32, 72 and 128 on 24 adapters, twice (two sweep rounds of 32 adapters against base-only, 64 requests).
# Usage: [BUDGET=seconds] bash benchmarks/h200_session36_c.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
budget=${BUDGET:-590}
timeout 90 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_stage.py -k "captured or reference" \
  > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 64 --hf-batch 0
  --micro-batch 32 72 128 --micro-adapters 24 --sweep-rounds 2 --lora-stage-slots 32)
echo "python -m mmlora.bench ${args[*]}" > "$out/command.txt"
timeout $((budget - SECONDS)) python -m mmlora.bench "${args[@]}" --out "$out/staged" > "$out/staged.log" 2>&1
echo "serving staged rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -ihE "Error|Traceback" "$out"/*.txt "$out"/*.log | head -8
grep -h "^decode step" "$out/staged.log" | cut -c1-600
python benchmarks/scripts/serving_summary.py "$out" staged 2>&1 | head -30
true
