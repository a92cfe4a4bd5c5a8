#!/usr/bin/env bash
# Session 33, second call (about 500 s): issue 13's serving command (default backend, 8 / 32 / 1000
# adapters, decode micro-benchmark, two sweep rounds) with the defaults, then again with the TUNING
# overrides in KNOBS (e.g. KNOBS="triton-sgmv:run_expand_h_unroll=16", through with_tuning.py), on one warm
# card in one call. Without KNOBS, only the first run.
# Usage: [KNOBS="backend:knob=json ..."] bash benchmarks/h200_session33_b.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
knobs=${KNOBS:-}
args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 --num-requests 192 --hf-batch 0
  --micro-batch 32 128 --sweep-rounds 2)
echo "python -m mmlora.bench ${args[*]}" > "$out/command.txt"
cap=$([ -n "$knobs" ] && echo 280 || echo 560)
timeout $cap python -m mmlora.bench "${args[@]}" --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
if [ -n "$knobs" ]; then
  echo "python benchmarks/scripts/with_tuning.py $knobs -- ${args[*]}" >> "$out/command.txt"
  # shellcheck disable=SC2086
  timeout $((575 - SECONDS)) python benchmarks/scripts/with_tuning.py $knobs -- "${args[@]}" --out "$out/knobs" \
    > "$out/knobs.log" 2>&1
  echo "serving with '$knobs' rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
fi
grep -ihE "Error|Traceback" "$out"/*.log | head -6
python benchmarks/scripts/serving_summary.py "$out" serving 2>&1 | head -40
[ -n "$knobs" ] && python benchmarks/scripts/serving_summary.py "$out" knobs 2>&1 | head -40
true
