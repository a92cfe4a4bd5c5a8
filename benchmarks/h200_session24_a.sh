#!/usr/bin/env bash
# CUDA graphs for prefill and mixed steps (mmlora.engine.mixed_graph, opt-in: --enable-mixed-cuda-graph):
# their GPU tests; issue 13's serving command with them on (8 / 32 / 1000 adapters, decode
# micro-benchmark, two rounds); the 32-adapter run with them off (the default), two rounds.
# Written in session 24; its one device call was lost with the machine (no output), so it has not run.
# Usage: bash benchmarks/h200_session24_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 110 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_mixed_graph.py > "$out/tests_mixed.txt" 2>&1
echo "mixed-graph tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests_mixed.txt")" | tee "$out/summary.txt"
timeout 250 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
  --num-requests 192 --hf-batch 0 --micro-batch 32 128 --sweep-rounds 2 --enable-mixed-cuda-graph --out "$out/serving" \
  > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((500 - SECONDS)) python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 \
  --num-requests 192 --hf-batch 0 --sweep-rounds 2 --out "$out/serving_off" \
  > "$out/serving_off.log" 2>&1
echo "serving off rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR|E  )" "$out/tests_mixed.txt" | head -8
grep -iE "captured|Error|Traceback" "$out/serving.log" | head -8
for f in serving serving_off; do grep "mmlora \|base-only ranks\|decode step\|mixed  " "$out/$f.log" | sed 's/.*run\/s\]//' | cut -c1-200; done
