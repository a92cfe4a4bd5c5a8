#!/usr/bin/env bash
# Session 14, call 5 (one H200), under 2.5 minutes, issue 23: the SGMV expand's rank step at rank 64.
#  1. The anatomy at rank 64 (decode runs, mixed step, prefill), SGMV expand_rank_step 16 (default), 32, 64.
#  2. GPU test of SGMV's real shapes (ranks 1-64 in a rank-64 pool) with expand_rank_step 64.
# Usage: bash benchmarks/h200_session14_e.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 90 python benchmarks/scripts/decode_lora_anatomy.py --rank 64 --cases decode-runs mixed prefill \
  --mode rs32:expand_rank_step=32 rs64:expand_rank_step=64 --rounds 2 --out "$out/anatomy_r64.json" \
  > "$out/anatomy_r64.txt" 2>&1
echo "anatomy rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
grep "==" "$out/anatomy_r64.txt"
timeout 45 python -c "
import sys, pytest
from mmlora.backends import triton_sgmv
triton_sgmv.TUNING['expand_rank_step'] = 64
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/kernels/test_lora_kernels.py', '-k', 'test_real_shapes_on_gpu and sgmv']))
" > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
tail -2 "$out/tests.txt"
