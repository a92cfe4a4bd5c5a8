#!/usr/bin/env bash
# Session 15, call 2 (one H200), under 9 minutes, issue 13, on the defaults of 78ecaeb (SGMV expand rank
# steps 32/64, eager forwards grouped by adapter):
#  1. GPU tests: LoRA kernels (real shapes, PDL, rank buckets) and the CUDA-graph runner. Stops if one fails.
#  2. Issue 13's serving command at 8, 32 and 1000 adapters, two rounds, decode micro-benchmark.
#  3. The model tests (HF + PEFT on the GPU) in the time left.
# Usage: bash benchmarks/h200_session15_b.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 100 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_lora_kernels.py tests/kernels/test_lora_pdl.py \
  tests/kernels/test_rank_buckets.py tests/kernels/test_cuda_graph.py > "$out/tests.txt" 2>&1
rc=$?
echo "kernel tests rc=$rc at ${SECONDS} s" | tee "$out/rc.txt"
tail -3 "$out/tests.txt"
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; then tail -60 "$out/tests.txt"; exit 1; fi
left=$((400 - SECONDS))
timeout "$left" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
  --num-requests 192 --hf-batch 0 --sweep-rounds 2 --micro-batch 32 128 --allow-compiles --out "$out/rounds" \
  > "$out/rounds.log" 2>&1
echo "rounds rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
python benchmarks/scripts/serving_summary.py "$out" rounds > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
left=$((530 - SECONDS))
timeout "$left" python -m pytest -q -p no:cacheprovider tests/models > "$out/tests_models.txt" 2>&1
echo "model tests rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
tail -3 "$out/tests_models.txt"
