#!/usr/bin/env bash
# Kernel tiles per rank bucket (a2a917d, written on CPU in session 16), first H200 measurement, under 8 min:
#  1. GPU tests: no Triton compile after the warm-up (now per rank bucket), rank buckets with NaN padding,
#     the paged pool (stops if one fails).
#  2. Anatomy of rank-16 adapters: a rank-16 pool, a rank-64 pool unpaged and paged by 16; rank 64; BGMV
#     with reduce_partials beside the default at ranks 16 and 64.
#     Session 16 c2 (tiles of the pool rank): 67 / - / 87 us decode runs B=128, 121 / - / 190 decode rows
#     B=128, 232 / - / 384 mixed; rank 64: 156 / 418 / 422.
#  3. Serving rank mixes {8}, {16}, {64}, {8,64} in an unpaged rank-64 pool, two rounds; compiles counted
#     (session 15, same command before the change: 0.675 / 0.731 / 0.607 / 0.675 worse runs).
# Usage: bash benchmarks/h200_buckets.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 130 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_lora_warmup.py \
  tests/kernels/test_rank_buckets.py tests/kernels/test_lora_paged.py > "$out/tests.txt" 2>&1
rc=$?
echo "tests rc=$rc at ${SECONDS} s" | tee "$out/rc.txt"
tail -3 "$out/tests.txt"
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; then tail -60 "$out/tests.txt"; exit 1; fi
A="timeout 60 python benchmarks/scripts/decode_lora_anatomy.py --cases decode-runs decode-rows mixed-sorted"
# BGMV cases also time TUNING["reduce_partials"] (split-K planes summed by torch before the expand) beside
# the default, in the same graphs.
M="--mode reduced:reduce_partials=true"
$A --rank 16 $M --out "$out/r16.json" > "$out/r16.txt" 2>&1
$A --rank 16 --pool-rank 64 --out "$out/r16_p64.json" > "$out/r16_p64.txt" 2>&1
$A --rank 16 --pool-rank 64 --page-rank 16 --out "$out/r16_p64_paged.json" > "$out/r16_p64_paged.txt" 2>&1
$A --rank 64 $M --out "$out/r64.json" > "$out/r64.txt" 2>&1
echo "anatomy done at ${SECONDS} s" | tee -a "$out/rc.txt"
for f in r16 r16_p64 r16_p64_paged r64; do echo "-- $f"; grep "==" "$out/$f.txt"; done
left=$((470 - SECONDS))
timeout "$left" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 \
  --hf-batch 0 --micro-batch --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 --sweep-rounds 2 \
  --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "mmlora \|base-only ranks\|compile" "$out/mixes.log" | sed 's/.*run\/s\]//'
