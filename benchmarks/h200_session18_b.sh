#!/usr/bin/env bash
# Session 18, second H200 call, under 9.5 minutes, on the working tree with (a) upload plans that no longer
# iterate paged B views (c1 loaded 32 rank-64 adapters in 211 s) and (b) cheaper eager LoRA launches: a
# launch plan's own memo of compiled kernels and one h buffer per module plan and forward (c1: an eager
# mixed step's forward took 42.5 ms of host time with 32 adapters against 18.8 ms base-only).
#  1. GPU tests of the direct launches, PDL, side-stream deltas, CUDA graphs, paged pools, rank buckets.
#  2. The mixed-step host profile again (as c1).
#  3. Issue 23's rank mixes in the default pool, two rounds (first-round TTFT with the upload plans).
# Usage: bash benchmarks/h200_session18_b.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 170 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_triton_launch.py \
  tests/kernels/test_lora_pdl.py tests/kernels/test_lora_side_delta.py tests/kernels/test_cuda_graph.py \
  tests/kernels/test_lora_paged.py tests/kernels/test_rank_buckets.py tests/unit/test_slot_loads_beside.py \
  > "$out/tests.txt" 2>&1
rc=$?
echo "tests rc=$rc at ${SECONDS} s" | tee "$out/rc.txt"
tail -3 "$out/tests.txt"
grep -E "^(FAILED|ERROR)" "$out/tests.txt" | head -20
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; then tail -60 "$out/tests.txt"; exit 1; fi
bash benchmarks/h200_mixed_profiles.sh "$out"
timeout $((570 - SECONDS)) python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 \
  --num-requests 192 --hf-batch 0 --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 --sweep-rounds 2 \
  --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "mmlora \|base-only ranks\|uploads" "$out/mixes.log" | sed 's/.*run\/s\]//'
