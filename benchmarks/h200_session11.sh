#!/usr/bin/env bash
# Session 11, call 1 (one H200), under 9.5 minutes: the overlap scheduler (mmlora.engine.overlap), issue 13.
#  1. GPU tests: overlap against serial steps with captured decode graphs (same tokens and logprobs),
#     direct Triton launches (BGMV's launch plans had not run on a GPU). Stops here if one fails.
#  2. benchmarks/scripts/overlap_ab.py: engine decode step with overlap on and off against its graph
#     replay, B=32 and 128, base-only and 32 adapters, two rounds in one process.
#  3. The serving command (overlap_schedule auto = on), --sweep-rounds 2, in one process.
# Usage: bash benchmarks/h200_session11.sh OUTDIR [serving flags...]
set -u
out=${1:?output folder}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 120 python -m pytest -q -p no:cacheprovider -x tests/unit/test_overlap_schedule.py \
  tests/kernels/test_triton_launch.py > "$out/tests.txt" 2>&1
rc=$?
echo "tests rc=$rc at ${SECONDS} s" | tee "$out/rc.txt"
if [ "$rc" -ne 0 ]; then tail -40 "$out/tests.txt"; exit 1; fi
timeout 170 python benchmarks/scripts/overlap_ab.py --out "$out/overlap_ab.json" > "$out/overlap_ab.txt" 2>&1
echo "overlap a/b rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
left=$((565 - SECONDS))
if [ "$left" -gt 200 ]; then
  timeout "$left" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
    --num-requests 192 --hf-batch 0 --sweep-rounds 2 --allow-compiles --out "$out/rounds" "$@" > "$out/rounds.log" 2>&1
  echo "rounds rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
fi
python benchmarks/scripts/serving_summary.py "$out" rounds > "$out/summary.txt" 2>&1
tail -3 "$out/tests.txt"
grep -v Warning "$out/overlap_ab.txt" | tail -10
cat "$out/summary.txt"
