#!/usr/bin/env bash
# Session 38, call 2 (about 450-550 s): issue 13's serving command (default backend, 8 / 32 / 1000 adapters,
# decode micro-benchmark, two sweep rounds) with the defaults and with --lora-stage-slots 32, now that the
# stage places a batch's adapters within the narrowest staged layout's positions (call a: at 1000 adapters
# 160 of 169-175 staged steps replayed the full-width graph for a few adapters; at 8 adapters round 2 did
# too). The stage becomes a default only if no ratio falls in either round. Then the stage's test file.
# Usage: bash benchmarks/h200_session38_b.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 --num-requests 192 --hf-batch 0
  --micro-batch 32 128 --sweep-rounds 2)
{
  echo "python -m mmlora.bench ${args[*]}"
  echo "python -m mmlora.bench ${args[*]} --lora-stage-slots 32"
} > "$out/command.txt"
timeout $(((560 - SECONDS) / 2)) python -m mmlora.bench "${args[@]}" --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
timeout $((560 - SECONDS)) python -m mmlora.bench "${args[@]}" --lora-stage-slots 32 --out "$out/staged" \
  > "$out/staged.log" 2>&1
echo "serving staged rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((590 - SECONDS)) python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_stage.py > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee -a "$out/summary.txt"
grep -ihE "Error|Traceback" "$out"/*.txt "$out"/*.log | head -8
python benchmarks/scripts/serving_summary.py "$out" serving staged 2>&1 | head -70
true
