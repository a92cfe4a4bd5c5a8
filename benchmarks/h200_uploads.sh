#!/usr/bin/env bash
# Upload plans with paged A views split by page and a module's B views joined (eceeff9, ea7549b; written
# in session 17 on CPU), first H200 measurement, under 8 minutes:
#  1. One upload's host and GPU time per rank (8, 16, 64) in an unpaged rank-64 pool, one paged by 16 and a
#     pool of the adapter's rank, two rounds; with ab_old/ (make it first, untracked:
#     mkdir ab_old && git archive 030b324 mmlora | tar -x -C ab_old) the old plans too, in the same call.
#  2. Issue 23's rank mixes in the default pool (rank 64, paged by 16), two rounds. Session 17 c3 on the old
#     plans: round-1 uploads of 32 rank-64 adapters 348 ms host / 498 ms GPU, TTFT p50 1.42x ({64}) and
#     1.65x ({8,64}) base-only; unpaged (c1) 83 / 235 ms and 1.24x / 1.34x.
# Usage: [BUDGET=seconds] bash benchmarks/h200_uploads.sh OUTDIR (BUDGET: when the mixes stop, default 470)
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD timeout 100 python benchmarks/scripts/upload_timing.py "$out/uploads_new.json" > "$out/uploads_new.txt" 2>&1
echo "uploads new rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
if [ -d ab_old/mmlora ]; then
  PYTHONPATH=$PWD/ab_old timeout 100 python benchmarks/scripts/upload_timing.py "$out/uploads_old.json" > "$out/uploads_old.txt" 2>&1
  echo "uploads old rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
fi
for f in "$out"/uploads_*.txt; do echo "-- $f"; grep '"round"' "$f" | python -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line[line.index('{'):])
    print(r['round'], r['rank'], r['pool'], 'host %.2f ms gpu %.2f ms' % (r['host_ms'], r['gpu_ms'] or 0), 'flat', r['flat_copies'], 'strided', r['strided_copies'])
"; done
PYTHONPATH=$PWD timeout $((${BUDGET:-470} - SECONDS)) python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 \
  --num-adapters 32 --num-requests 192 --hf-batch 0 --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 \
  --sweep-rounds 2 --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "mmlora \|base-only ranks\|uploads" "$out/mixes.log" | sed 's/.*run\/s\]//'
