#!/usr/bin/env bash
# Session 32, second call: issue 13's serving command (default backend, 8 / 32 / 1000 adapters, decode
# micro-benchmark, two sweep rounds). With EXTRA set (e.g. EXTRA="--weight-layout column-major", after
# h200_session32_a.sh found the layout faster in both rounds at every batch), the same command runs a
# second time with it, so both are measured on one warm card in one call; then the layout's GPU test.
# Usage: [EXTRA="flags"] bash benchmarks/h200_session32_b.sh OUTDIR
set -u
out=${1:?output folder}
extra=${EXTRA:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
date -u > "$out/date.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
cmd=(python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 --num-requests 192
  --hf-batch 0 --micro-batch 32 128 --sweep-rounds 2)
echo "${cmd[*]}" > "$out/command.txt"
cap=$([ -n "$extra" ] && echo 270 || echo 560)
timeout $cap "${cmd[@]}" --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
if [ -n "$extra" ]; then
  echo "${cmd[*]} $extra" >> "$out/command.txt"
  # shellcheck disable=SC2086
  timeout $((555 - SECONDS)) "${cmd[@]}" $extra --out "$out/serving_extra" > "$out/serving_extra.log" 2>&1
  echo "serving with '$extra' rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
  timeout $((590 - SECONDS)) python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_weight_layout.py \
    > "$out/tests.txt" 2>&1
  echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee -a "$out/summary.txt"
fi
grep -ihE "Error|Traceback" "$out"/serving*.log | head -6
python benchmarks/scripts/serving_summary.py "$out" serving 2>&1 | head -40
[ -n "$extra" ] && python benchmarks/scripts/serving_summary.py "$out" serving_extra 2>&1 | head -40
true
