#!/usr/bin/env bash
# Session 16, call 2 (one H200; the first try was taken back unfinished), under 8 minutes: expand loads bounded by rank_load_bound (vector loads)
# against the previous commit's kernels (ab_old/, an export of 1688f58's mmlora/), then rank mixes.
#  1. GPU kernel tests (stops if one fails).
#  2. Anatomy, old and new side by side: rank 16 in a rank-16 pool, rank 16 in a rank-64 pool paged by 16,
#     rank 64; two rounds each (the script times twice).
#  3. Serving rank mixes {8}, {16}, {64}, {8,64} in a rank-64 pool paged by 16, two rounds (as call 1).
# Usage: bash benchmarks/h200_session16_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD timeout 100 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_lora_kernels.py \
  tests/kernels/test_lora_paged.py > "$out/tests.txt" 2>&1
rc=$?
echo "tests rc=$rc at ${SECONDS} s" | tee "$out/rc.txt"
tail -3 "$out/tests.txt"
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; then tail -60 "$out/tests.txt"; exit 1; fi
A="timeout 60 python benchmarks/scripts/decode_lora_anatomy.py --cases decode-runs decode-rows mixed-sorted"
for v in new old; do
  if [ $v = new ]; then P=$PWD; else P=$PWD/ab_old:$PWD; fi
  PYTHONPATH=$P $A --rank 16 --out "$out/r16_$v.json" > "$out/r16_$v.txt" 2>&1
  PYTHONPATH=$P $A --rank 16 --pool-rank 64 --page-rank 16 --out "$out/r16_p64_paged_$v.json" > "$out/r16_p64_paged_$v.txt" 2>&1
  PYTHONPATH=$P $A --rank 64 --out "$out/r64_$v.json" > "$out/r64_$v.txt" 2>&1
done
echo "anatomy done at ${SECONDS} s" | tee -a "$out/rc.txt"
for f in r16 r16_p64_paged r64; do for v in new old; do echo "-- ${f}_$v"; grep "==" "$out/${f}_$v.txt"; done; done
left=$((480 - SECONDS))
PYTHONPATH=$PWD timeout "$left" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 \
  --num-requests 192 --hf-batch 0 --micro-batch --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 \
  --lora-page-rank 16 --sweep-rounds 2 --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "mmlora \|base-only ranks" "$out/mixes.log" | sed 's/.*run\/s\]//'
