#!/usr/bin/env bash
# Session 20, call 3: PageMap.choose before (ab_old/: `git archive 85e226c mmlora`) and after (bf26675),
# 1000 adapters, two rounds each against their own base-only runs: the schedule phase's host time, which
# at 1000 adapters was 621-848 ms against 254-324 at 32 adapters (call 2). Then the new code once more.
# Usage: bash benchmarks/h200_session20_c.sh OUTDIR   (with ab_old/ made beside it)
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() {
  PYTHONPATH=$1 timeout 170 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 1000 \
    --num-requests 192 --hf-batch 0 --micro-batch --sweep-rounds 2 --out "$out/$2" > "$out/$2.log" 2>&1
  echo "$2 rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
}
run "$PWD/ab_old" old
run "$PWD" new
run "$PWD/ab_old" old2
for f in old new old2; do
  echo "== $f"
  tr '\r' '\n' < "$out/$f.log" | grep -A5 "base-only ranks\|mmlora    ranks" | grep "ranks\|host ms" | sed 's/.*run\/s\]//' | cut -c1-200
done
