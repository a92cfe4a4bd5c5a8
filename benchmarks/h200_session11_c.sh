#!/usr/bin/env bash
# Session 11, call 3 (one H200), under 9.5 minutes, after the slot-rank write stopped syncing the upload
# stream (call 2: 10.3 ms of host time per slot load with the main stream busy, 1.9 ms idle):
#  1. GPU tests: that a slot load never synchronizes (sync debug mode), overlap against serial steps.
#  2. The issue-13 serving command (overlap on), --sweep-rounds 2, then issue 23's rank mixes, two rounds.
# Usage: bash benchmarks/h200_session11_c.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 100 python -m pytest -q -p no:cacheprovider -x tests/unit/test_slot_loads_beside.py \
  tests/unit/test_overlap_schedule.py > "$out/tests.txt" 2>&1
rc=$?
echo "tests rc=$rc at ${SECONDS} s" | tee "$out/rc.txt"
if [ "$rc" -ne 0 ]; then tail -40 "$out/tests.txt"; exit 1; fi
timeout 230 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
  --num-requests 192 --hf-batch 0 --sweep-rounds 2 --allow-compiles --out "$out/rounds" > "$out/rounds.log" 2>&1
echo "rounds rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
left=$((565 - SECONDS))
timeout "$left" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 \
  --hf-batch 0 --micro-batch --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 --sweep-rounds 2 \
  --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
tail -3 "$out/tests.txt"
python benchmarks/scripts/serving_summary.py "$out" rounds > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
grep -E "ranks" "$out/mixes.log" | grep -v "^ " | sed 's/.*mmlora /mmlora /; s/.*base-only /base-only /' | tail -10
