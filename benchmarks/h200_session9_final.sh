#!/usr/bin/env bash
# Session 9, call 3 (one H200), under 9 minutes:
#  1. benchmarks/h200_ranks.sh: issue 23's rank mixes, two valid rounds (the prefix cache is now emptied
#     before every timed run; session 8's round 2 predates that).
#  2. If time is left: benchmarks/scripts/step_host_profile.py at B=128: where the host time between a
#     decode step's graph replays goes (issue 13 item 5: the engine step is 4.8-5.7 ms longer than its
#     replay at B=128).
# Usage: bash benchmarks/h200_session9_final.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash benchmarks/h200_ranks.sh "$out/ranks" > "$out/ranks.log" 2>&1
echo "ranks rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
if [ "$SECONDS" -lt 470 ]; then
  timeout 70 python benchmarks/scripts/step_host_profile.py --batch 128 --steps 20 > "$out/step_host_profile.txt" 2>&1
  echo "step host profile rc=$?" | tee -a "$out/rc.txt"
fi
cat "$out/ranks/summary.txt"
head -60 "$out/step_host_profile.txt" 2>/dev/null
