#!/usr/bin/env bash
# Session 37, call 1 (about 590 s): the staged shrink's CUDA tests (now with paged pools), then issue 13's
# serving command (default backend, 8 / 32 / 1000 adapters, decode micro-benchmark, two sweep rounds) with
# the defaults and with --lora-stage-slots 32 and a segment entry per row in the staged graphs
# (triton-auto:staged_segments="rows": in session 36, 231 of 508 LoRA decode steps had more runs than half
# their rows and could not take the stage), each with half of what is left. The stage becomes a default
# only if no ratio falls in either round (1000 adapters churn through its positions).
# Usage: bash benchmarks/h200_session37_a.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
timeout 120 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_stage.py > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 --num-requests 192 --hf-batch 0
  --micro-batch 32 128 --sweep-rounds 2)
{
  echo "python -m mmlora.bench ${args[*]}"
  echo "python benchmarks/scripts/with_tuning.py 'triton-auto:staged_segments=\"rows\"' -- ${args[*]} --lora-stage-slots 32"
} > "$out/command.txt"
timeout $(((590 - SECONDS) / 2)) python -m mmlora.bench "${args[@]}" --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((585 - SECONDS)) python benchmarks/scripts/with_tuning.py 'triton-auto:staged_segments="rows"' -- \
  "${args[@]}" --lora-stage-slots 32 --out "$out/staged_rows" > "$out/staged_rows.log" 2>&1
echo "serving staged, a segment per row rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -ihE "Error|Traceback" "$out"/*.txt "$out"/*.log | head -8
python benchmarks/scripts/serving_summary.py "$out" serving staged_rows 2>&1 | head -70
true
