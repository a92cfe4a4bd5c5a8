#!/usr/bin/env bash
# Session 12, call 1 (one H200), under 9.5 minutes: slot loads beside the forwards without the admission
# cascade (ae88764) and without the synchronizing slot-rank write, issues 13 and 23.
#  1. GPU tests: slot loads on the upload stream (never synchronizing), overlap against serial steps.
#  2. The issue-13 serving command with the decode microbenchmark, --sweep-rounds 2, in one process.
#  3. Issue 23's rank mixes, two rounds, with what time is left.
# Usage: bash benchmarks/h200_session12.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 100 python -m pytest -q -p no:cacheprovider -x tests/unit/test_slot_loads_beside.py \
  tests/unit/test_overlap_schedule.py > "$out/tests.txt" 2>&1
rc=$?
echo "tests rc=$rc at ${SECONDS} s" | tee "$out/rc.txt"
if [ "$rc" -ne 0 ]; then tail -40 "$out/tests.txt"; exit 1; fi
timeout 300 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
  --num-requests 192 --hf-batch 0 --sweep-rounds 2 --micro-batch --allow-compiles --out "$out/rounds" \
  > "$out/rounds.log" 2>&1
echo "rounds rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
python benchmarks/scripts/serving_summary.py "$out" rounds > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
left=$((560 - SECONDS))
if [ "$left" -gt 150 ]; then
  timeout "$left" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 \
    --num-requests 192 --hf-batch 0 --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 \
    --sweep-rounds 2 --out "$out/mixes" > "$out/mixes.log" 2>&1
  echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
  grep -E "ranks" "$out/mixes.log" | grep -v "^ " | sed 's/.*mmlora /mmlora /; s/.*base-only /base-only /' | tail -12
fi
tail -3 "$out/tests.txt"
