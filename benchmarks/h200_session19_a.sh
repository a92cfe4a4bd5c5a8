#!/usr/bin/env bash
# Prepared in session 18 (CPU only, not yet run on a GPU) for the next session's first H200 call, about 5
# minutes:
#  1. GPU test of SGMV's knobs for 16-token tiles against the reference (tests/kernels/test_lora_kernels.py).
#  2. The decode-runs LoRA anatomy (rank-16 adapters in the default rank-64 pool paged by 16) with those
#     knobs swept as modes (off by default): run_waves 4 and 8, run_shrink_block_k 256 and 512,
#     run_shrink_stages 4 and 5, run_expand_early_out. Session 17 c1: 67.1 us over the four projections at
#     B=128, down's shrink 13 us against about 4 us of bytes, o's expand 5.0 us for 6 MB.
# Then benchmarks/h200_session19_b.sh: issue 13's serving command.
# Usage: bash benchmarks/h200_session19_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 60 python -m pytest -q -p no:cacheprovider tests/kernels/test_lora_kernels.py -k run_knobs \
  > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
tail -2 "$out/tests.txt"
timeout 240 python benchmarks/scripts/decode_lora_anatomy.py --cases decode-runs --rank 16 --pool-rank 64 \
  --page-rank 16 --mode w4:run_waves=4 w8:run_waves=8 bk256:run_shrink_block_k=256 \
  bk512:run_shrink_block_k=512 bk256w4:run_shrink_block_k=256,run_waves=4 eo:run_expand_early_out=true \
  s4:run_shrink_stages=4 s5:run_shrink_stages=5 all:run_shrink_block_k=256,run_waves=4,run_expand_early_out=true \
  --out "$out/runs_knobs.json" > "$out/runs_knobs.txt" 2>&1
echo "anatomy rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "==" "$out/runs_knobs.txt"
# 3. The kernel and launch tests over the modules moved in session 18 (triton_sgmv_kernels.py,
#    triton_checks.py), not yet run on a GPU since the move.
timeout 220 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_triton_launch.py \
  tests/kernels/test_lora_pdl.py tests/kernels/test_lora_paged.py tests/kernels/test_rank_buckets.py \
  > "$out/moved_tests.txt" 2>&1
echo "moved-module tests rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
tail -3 "$out/moved_tests.txt"
