#!/usr/bin/env bash
# Session 15, call 4 (one H200), under 7 minutes, issues 13 and 23:
#  1. GPU tests, three processes side by side: the LoRA kernel and CUDA-graph tests on the defaults (call 2
#     ran out of its cap at 60%, none failing), and SGMV's with h_width "bound".
#  2. The anatomy of rank-16 adapters in a rank-64 pool (decode runs and rows, mixed-sorted), against a
#     rank-16 pool: why {16} in a rank-64 pool decodes 0.65 s slower than in a rank-16 pool. Modes: SGMV
#     h as wide as the batch's rank bound (hb), the run expand's rank step 16 (rs16).
#  3. The anatomy at rank 64, BGMV decode rows: the expand's rank tile 32 and 64.
#  4. If hb made the B=128 decode runs faster in its worse round: serving {8} and {16} in a rank-64 pool
#     (32 adapters, two rounds) with it.
# Usage: bash benchmarks/h200_session15_d.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T="python -m pytest -q -p no:cacheprovider"
timeout 150 $T tests/kernels/test_lora_kernels.py > "$out/tests_kernels.txt" 2>&1 &
p1=$!
timeout 150 $T tests/kernels/test_lora_pdl.py tests/kernels/test_rank_buckets.py tests/kernels/test_cuda_graph.py \
  > "$out/tests_graphs.txt" 2>&1 &
p2=$!
timeout 150 python -c "
import sys, pytest
from mmlora.backends import triton_sgmv
triton_sgmv.TUNING['h_width'] = 'bound'
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/kernels/test_lora_kernels.py', 'tests/kernels/test_rank_buckets.py',
                      'tests/kernels/test_cuda_graph.py', '-k', 'sgmv or auto or rank']))
" > "$out/tests_hb.txt" 2>&1 &
p3=$!
wait $p1; r1=$?; wait $p2; r2=$?; wait $p3; r3=$?
echo "tests rc=$r1 $r2 $r3 at ${SECONDS} s" | tee "$out/rc.txt"
for f in tests_kernels tests_graphs tests_hb; do tail -1 "$out/$f.txt"; done
A="python benchmarks/scripts/decode_lora_anatomy.py"
timeout 90 $A --rank 16 --pool-rank 64 --cases decode-runs decode-rows mixed-sorted --mode 'hb:h_width="bound"' \
  rs16:run_expand_rank_step=16 --out "$out/anatomy_r16_p64.json" > "$out/anatomy_r16_p64.txt" 2>&1
echo "anatomy r16 pool 64 rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "==" "$out/anatomy_r16_p64.txt"
timeout 60 $A --rank 16 --cases decode-runs decode-rows mixed-sorted --out "$out/anatomy_r16.json" \
  > "$out/anatomy_r16.txt" 2>&1
echo "anatomy r16 rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "==" "$out/anatomy_r16.txt"
timeout 60 $A --rank 64 --cases decode-rows --mode brt32:expand_rank_tile=32 brt64:expand_rank_tile=64 \
  --profile-mode brt64 --out "$out/anatomy_r64_rows.json" > "$out/anatomy_r64_rows.txt" 2>&1
echo "anatomy r64 rows rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "==" "$out/anatomy_r64_rows.txt"
pick=$(python - "$out/anatomy_r16_p64.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["results"]
    row = next(r for r in rows if r["case"] == "decode-runs" and r["B"] == 128 and r["segments"] == 64)
    print("yes" if max(row["hb"]) < min(row["default"]) else "no")
except Exception:
    print("no")
PY
)
echo "serving with h_width bound: $pick" | tee -a "$out/rc.txt"
if [ "$pick" = yes ]; then
  left=$((400 - SECONDS))
  timeout "$left" python -c "
import sys
from mmlora.backends import triton_sgmv
triton_sgmv.TUNING['h_width'] = 'bound'
from mmlora.bench.__main__ import main
sys.exit(main(sys.argv[1:]))
" serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --micro-batch \
    --allow-compiles --rank-mixes 8 16 --pool-rank 64 --sweep-rounds 2 --out "$out/mixes" > "$out/mixes.log" 2>&1
  echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
  grep "mmlora \|base-only ranks" "$out/mixes.log" | sed 's/.*run\/s\]//'
fi
