#!/usr/bin/env bash
# Session 15, call 1 (one H200), under 8 minutes, issues 23 and 13: the SGMV expand's rank step.
#  1. GPU test of SGMV's real shapes (ranks 1-64 in a rank-64 pool) with expand_rank_step 64.
#  2. The anatomy at rank 64 (decode runs, mixed step, prefill): expand_rank_step 16 (default), 32, 64,
#     and fewer split-K planes (max_split_k 4) with and without step 64; two rounds each.
#  3. The anatomy at rank 16 with max_split_k 4 and 8 (the split's planes are what the expand reloads).
#  Both anatomies include mixed-sorted: the mixed step with its decode rows side by side per adapter.
#  4. Serving with rank mixes {64} and {8,64} (32 adapters, rank-64 pool, two rounds) with the rank step
#     that was fastest on step 2's mixed case (its worse round), said in the log.
# Usage: bash benchmarks/h200_session15_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 60 python -c "
import sys, pytest
from mmlora.backends import triton_sgmv
triton_sgmv.TUNING['expand_rank_step'] = 64
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/kernels/test_lora_kernels.py', '-k', 'test_real_shapes_on_gpu and sgmv']))
" > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
tail -2 "$out/tests.txt"
timeout 120 python benchmarks/scripts/decode_lora_anatomy.py --rank 64 --cases decode-runs mixed mixed-sorted prefill \
  --mode rs32:expand_rank_step=32 rs64:expand_rank_step=64 ms4:max_split_k=4 \
  rs64ms4:expand_rank_step=64,max_split_k=4 --profile-mode rs64 --out "$out/anatomy_r64.json" \
  > "$out/anatomy_r64.txt" 2>&1
echo "anatomy r64 rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "==" "$out/anatomy_r64.txt"
timeout 90 python benchmarks/scripts/decode_lora_anatomy.py --rank 16 --cases decode-runs mixed mixed-sorted prefill \
  --mode ms4:max_split_k=4 ms8:max_split_k=8 --out "$out/anatomy_r16.json" > "$out/anatomy_r16.txt" 2>&1
echo "anatomy r16 rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "==" "$out/anatomy_r16.txt"
pick=$(python - "$out/anatomy_r64.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["results"]
    row = next(r for r in rows if r["case"] == "mixed")
    modes = {m: max(row[m]) for m in ("default", "rs32", "rs64") if m in row}
    print({"default": "{}", "rs32": '{"expand_rank_step": 32}', "rs64": '{"expand_rank_step": 64}'}[min(modes, key=modes.get)])
except Exception:
    print("{}")
PY
)
echo "serving with SGMV TUNING overrides $pick" | tee -a "$out/rc.txt"
left=$((440 - SECONDS))
timeout "$left" python -c "
import json, sys
from mmlora.backends import triton_sgmv
triton_sgmv.TUNING.update(json.loads(sys.argv[1]))
from mmlora.bench.__main__ import main
sys.exit(main(sys.argv[2:]))
" "$pick" serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 \
  --micro-batch --allow-compiles --rank-mixes 64 8,64 --pool-rank 64 --sweep-rounds 2 \
  --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
python benchmarks/scripts/serving_summary.py "$out" mixes > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
