#!/usr/bin/env bash
# Session 22, call 5: the fused activation's GPU tests with its final defaults (eager steps with token tiles
# above 16 only), then issue 13's serving command (8 / 32 / 1000 adapters, decode micro-benchmark, two
# rounds) and the same 32-adapter serving run with the fusion off (act_expand=false), two rounds.
# Usage: bash benchmarks/h200_session22_d.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 80 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_act_expand.py > "$out/tests_act.txt" 2>&1
echo "act tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests_act.txt")" | tee "$out/summary.txt"
timeout 200 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
  --num-requests 192 --hf-batch 0 --micro-batch 32 128 --sweep-rounds 2 --out "$out/serving" \
  > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((430 - SECONDS)) python benchmarks/scripts/with_tuning.py triton-sgmv:act_expand=false -- serving \
  --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --sweep-rounds 2 \
  --out "$out/serving_off" > "$out/serving_off.log" 2>&1
echo "serving off rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -E "^(FAILED|E  )" "$out/tests_act.txt" | head -5
for f in serving serving_off; do grep "mmlora \|base-only ranks\|decode step\|mixed  " "$out/$f.log" | sed 's/.*run\/s\]//' | cut -c1-200; done
