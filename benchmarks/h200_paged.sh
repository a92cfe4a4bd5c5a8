#!/usr/bin/env bash
# The first H200 measurement of lora_page_rank (issue 23, written on CPU in session 15), under 9 minutes:
#  1. GPU tests of the paged pool (kernels at real shapes, engine through the pool's own views) and of
#     the unpaged kernels (the constexpr branch): stops if one fails.
#  2. The anatomy of rank-16 adapters in a rank-64 pool, unpaged and paged by 16, against a rank-16 pool;
#     rank-64 adapters paged by 16 against unpaged (the layout must not slow them).
#  3. Serving rank mixes {8}, {16}, {64}, {8,64} in a rank-64 pool, paged by 16, two rounds (compare with
#     session 15's unpaged c3: 0.675 / 0.731 / 0.607 / 0.675 worse runs).
# Usage: bash benchmarks/h200_paged.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 120 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_lora_paged.py tests/kernels/test_rank_buckets.py \
  > "$out/tests.txt" 2>&1
rc=$?
echo "tests rc=$rc at ${SECONDS} s" | tee "$out/rc.txt"
tail -3 "$out/tests.txt"
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; then tail -60 "$out/tests.txt"; exit 1; fi
A="timeout 80 python benchmarks/scripts/decode_lora_anatomy.py --cases decode-runs decode-rows mixed-sorted"
$A --rank 16 --pool-rank 64 --out "$out/r16_p64.json" > "$out/r16_p64.txt" 2>&1
$A --rank 16 --pool-rank 64 --page-rank 16 --out "$out/r16_p64_paged.json" > "$out/r16_p64_paged.txt" 2>&1
$A --rank 16 --out "$out/r16.json" > "$out/r16.txt" 2>&1
$A --rank 64 --page-rank 16 --out "$out/r64_paged.json" > "$out/r64_paged.txt" 2>&1
$A --rank 64 --out "$out/r64.json" > "$out/r64.txt" 2>&1
echo "anatomy done at ${SECONDS} s" | tee -a "$out/rc.txt"
for f in r16_p64 r16_p64_paged r16 r64_paged r64; do echo "-- $f"; grep "==" "$out/$f.txt"; done
left=$((530 - SECONDS))
timeout "$left" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 \
  --hf-batch 0 --micro-batch --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 --lora-page-rank 16 \
  --sweep-rounds 2 --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "mmlora \|base-only ranks" "$out/mixes.log" | sed 's/.*run\/s\]//'
