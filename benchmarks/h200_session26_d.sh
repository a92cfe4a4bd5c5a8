#!/usr/bin/env bash
# Session 26's last call: the defaults after c1-c3 (mixed-step CUDA graphs on, the norm-fused expand
# removed). The GPU tests of both graph runners and the fused activation, then issue 13's serving command
# exactly as the issue gives it (no flags beyond it: default backend, mixed graphs by default), two rounds.
# Usage: bash benchmarks/h200_session26_d.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
timeout 170 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_mixed_graph.py \
  tests/kernels/test_cuda_graph.py tests/kernels/test_act_expand.py > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
timeout $((560 - SECONDS)) python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 \
  --num-adapters 8 32 1000 --num-requests 192 --hf-batch 0 --micro-batch 32 128 --sweep-rounds 2 \
  --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR)" "$out/tests.txt" | head -8
grep -iE "captured|Error|Traceback" "$out/serving.log" | head -8
grep "mmlora \|base-only ranks\|decode step" "$out/serving.log" | sed 's/.*run\/s\]//' | cut -c1-200
