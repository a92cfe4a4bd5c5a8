set -u
out=$OUT/c2; mkdir -p $out; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for tile in True False; do
timeout 80 python -c "
import sys, pytest
from mmlora.backends import triton_sgmv
triton_sgmv.TUNING['run_plane_tile'] = $tile
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/kernels/test_lora_kernels.py', '-k', 'test_real_shapes_on_gpu and sgmv']))
" > $out/tests_tile_$tile.txt 2>&1; echo "tile=$tile rc=$? at $SECONDS"; tail -4 $out/tests_tile_$tile.txt
done
timeout 200 python benchmarks/scripts/decode_lora_anatomy.py --rank 16 --cases decode-runs decode-rows mixed \
  --mode nopdl:pdl=false --profile-mode nopdl --out $out/anatomy_nopdl.json > $out/anatomy_nopdl.txt 2>&1
echo "anatomy rc=$? at $SECONDS"; grep -v Warn $out/anatomy_nopdl.txt
