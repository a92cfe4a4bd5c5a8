#!/usr/bin/env bash
# Session 12, call 1 (one H200), under 9.5 minutes, issues 13 and 23:
#  1. GPU tests: slot loads on the upload stream (never synchronizing; the admission cascade, ae88764),
#     overlap against serial steps, the LoRA expand as a programmatic dependent launch (PDL), direct
#     Triton launches. Stops here if one fails.
#  2. benchmarks/scripts/lora_pdl_ab.py: decode graphs with PDL and/or the side-stream shrink, B=32/64/128.
#  3. The issue-13 serving command with the decode microbenchmark, --sweep-rounds 2, in one process.
# Usage: bash benchmarks/h200_session12.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 130 python -m pytest -q -p no:cacheprovider -x tests/unit/test_slot_loads_beside.py \
  tests/unit/test_overlap_schedule.py tests/kernels/test_lora_pdl.py tests/kernels/test_triton_launch.py \
  > "$out/tests.txt" 2>&1
rc=$?
echo "tests rc=$rc at ${SECONDS} s" | tee "$out/rc.txt"
if [ "$rc" -ne 0 ]; then tail -60 "$out/tests.txt"; exit 1; fi
timeout 150 python benchmarks/scripts/lora_pdl_ab.py --out "$out/pdl_ab.json" > "$out/pdl_ab.txt" 2>&1
echo "pdl a/b rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep -v Warning "$out/pdl_ab.txt" | tail -12
left=$((565 - SECONDS))
timeout "$left" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
  --num-requests 192 --hf-batch 0 --sweep-rounds 2 --micro-batch --allow-compiles --out "$out/rounds" \
  > "$out/rounds.log" 2>&1
echo "rounds rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
python benchmarks/scripts/serving_summary.py "$out" rounds > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
tail -3 "$out/tests.txt"
