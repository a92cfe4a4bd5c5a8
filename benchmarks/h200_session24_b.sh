#!/usr/bin/env bash
# Session 24's opt-ins on a GPU, part 2 of 2 (see h200_session24_a.sh; not yet run): issue 13's serving
# command with mixed-step CUDA graphs on (8 / 32 / 1000 adapters, decode micro-benchmark, two rounds), with
# the TUNING overrides given (e.g. triton-sgmv-norm:norm_expand=true, where part 1 found it faster), then
# the 32-adapter run with everything off (the defaults), two rounds.
# Usage: bash benchmarks/h200_session24_b.sh OUTDIR [BACKEND:KNOB=JSON ...]
set -u
out=${1:?output folder}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
echo "overrides: ${*:-none}" | tee "$out/summary.txt"
timeout 300 python benchmarks/scripts/with_tuning.py "$@" -- serving --model dummy:mistral-7b-v0.3 \
  --num-adapters 8 32 1000 --num-requests 192 --hf-batch 0 --micro-batch 32 128 --sweep-rounds 2 \
  --enable-mixed-cuda-graph --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((540 - SECONDS)) python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 \
  --num-requests 192 --hf-batch 0 --sweep-rounds 2 --out "$out/serving_off" > "$out/serving_off.log" 2>&1
echo "serving off rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -iE "captured|Error|Traceback" "$out/serving.log" | head -8
for f in serving serving_off; do grep "mmlora \|base-only ranks\|decode step\|mixed  " "$out/$f.log" | sed 's/.*run\/s\]//' | cut -c1-200; done
