#!/usr/bin/env bash
# Session 14, call 2 (one H200): is the SGMV decode-runs slowdown since session 8 (80.8 -> 164 us) in the
# code, and which part? (1) the GPU test that failed in call 1, plane tile on and off; (2) the same three
# decode cases on session 8's code (c15a521, carried in .old_s8) and on this code: default, PDL off, fast
# launches off; (3) the anatomy with PDL off (clean per-kernel times).
# Usage: bash benchmarks/h200_session14_b.sh (writes $OUT/c2)
set -u
out=$OUT/c2; mkdir -p $out; export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
for tile in True False; do
timeout 60 python -c "
import sys, pytest
from mmlora.backends import triton_sgmv
triton_sgmv.TUNING['run_plane_tile'] = $tile
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/kernels/test_lora_kernels.py', '-k', 'test_real_shapes_on_gpu and sgmv and zipf']))
" > $out/tests_tile_$tile.txt 2>&1; echo "tile=$tile rc=$? at $SECONDS"; tail -3 $out/tests_tile_$tile.txt
done
(cd .old_s8 && PYTHONPATH=$PWD timeout 100 python benchmarks/scripts/lora_case_times.py) > $out/times_s8.txt 2>&1
echo "== session 8 code (c15a521)"; grep -v Warn $out/times_s8.txt | grep decode
timeout 100 python benchmarks/scripts/lora_case_times.py > $out/times_now.txt 2>&1
echo "== now"; grep decode $out/times_now.txt
timeout 100 python benchmarks/scripts/lora_case_times.py --sgmv '{"pdl": false}' --bgmv '{"pdl": false}' > $out/times_nopdl.txt 2>&1
echo "== now, pdl off"; grep decode $out/times_nopdl.txt
timeout 100 python benchmarks/scripts/lora_case_times.py --bgmv '{"row_fastest": true}' > $out/times_rowfast.txt 2>&1
echo "== now, BGMV row_fastest"; grep decode $out/times_rowfast.txt
MMLORA_TRITON_FAST_LAUNCH=0 timeout 100 python benchmarks/scripts/lora_case_times.py > $out/times_nofast.txt 2>&1
echo "== now, fast launch off"; grep decode $out/times_nofast.txt
left=$((560 - SECONDS))
timeout $left python benchmarks/scripts/decode_lora_anatomy.py --rank 16 --cases decode-runs decode-rows mixed \
  --mode nopdl:pdl=false rowfast:row_fastest=true w1:run_expand_warps=1 w4:run_expand_warps=4 bn128:block_n=128 bn512:block_n=512 st1:run_expand_stages=1 st2:run_expand_stages=2 --profile-mode nopdl --out $out/anatomy_nopdl.json > $out/anatomy_nopdl.txt 2>&1
echo "anatomy rc=$? at $SECONDS"; grep -v Warn $out/anatomy_nopdl.txt
