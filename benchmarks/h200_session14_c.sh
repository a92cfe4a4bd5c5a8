#!/usr/bin/env bash
# Session 14, call 3 (one H200), under 9.5 minutes, issue 13:
#  1. GPU tests: LoRA kernels (real shapes, PDL chains, side delta, rank buckets) and the CUDA-graph runner,
#     with the expands' PDL wait moved out of their rank loops. Stops if one fails.
#  2. The anatomy (decode runs and rows, mixed step), with SGMV run-expand knobs (stages, warps, column
#     tile) and PDL off, two rounds each.
#  3. Serving, issue 13's command at 32 adapters, two rounds, with the run-expand setting that was fastest
#     on the decode runs (B=128) in step 2 (its worse round), said in the log.
# Usage: bash benchmarks/h200_session14_c.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 110 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_lora_kernels.py tests/kernels/test_lora_pdl.py \
  tests/kernels/test_lora_side_delta.py tests/kernels/test_rank_buckets.py tests/kernels/test_cuda_graph.py \
  > "$out/tests.txt" 2>&1
rc=$?
echo "kernel tests rc=$rc at ${SECONDS} s" | tee "$out/rc.txt"
tail -3 "$out/tests.txt"
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; then exit 1; fi
timeout 150 python benchmarks/scripts/decode_lora_anatomy.py --rank 16 --cases decode-runs decode-rows mixed \
  --mode nopdl:pdl=false st1:run_expand_stages=1 st2:run_expand_stages=2 w1:run_expand_warps=1 \
  bn512:block_n=512 st1w1:run_expand_stages=1,run_expand_warps=1 --profile-mode default \
  --out "$out/anatomy.json" > "$out/anatomy.txt" 2>&1
echo "anatomy rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "==" "$out/anatomy.txt"
pick=$(python - "$out/anatomy.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["results"]
    row = next(r for r in rows if r["case"] == "decode-runs" and r["B"] == 128 and r["segments"] == 64)
    modes = {m: max(row[m]) for m in ("default", "st1", "st2", "w1", "bn512", "st1w1") if m in row}
    best = min(modes, key=modes.get)
    print({"default": "{}", "st1": '{"run_expand_stages": 1}', "st2": '{"run_expand_stages": 2}',
           "w1": '{"run_expand_warps": 1}', "bn512": '{"block_n": 512}',
           "st1w1": '{"run_expand_stages": 1, "run_expand_warps": 1}'}[best])
except Exception as exc:
    print("{}")
PY
)
echo "serving with SGMV TUNING overrides $pick" | tee -a "$out/rc.txt"
left=$((555 - SECONDS))
timeout "$left" python -c "
import json, sys
from mmlora.backends import triton_sgmv
triton_sgmv.TUNING.update(json.loads(sys.argv[1]))
from mmlora.bench.__main__ import main
sys.exit(main(sys.argv[2:]))
" "$pick" serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 \
  --sweep-rounds 2 --micro-batch 32 128 --allow-compiles --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
python benchmarks/scripts/serving_summary.py "$out" serving > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
