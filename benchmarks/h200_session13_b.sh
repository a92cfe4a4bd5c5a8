#!/usr/bin/env bash
# Session 13, call 2 (one H200), under 8 minutes, issue 13:
#  1. GPU tests: the side delta and SGMV's prefill split (chains, eager and graph), the two-phase LoRA, PDL.
#     Stops if one fails.
#  2. benchmarks/scripts/lora_prefill_side_ab.py: prefill forwards' GPU time, SGMV shrink beside the GEMM
#     (TUNING["side_min_tokens"] = 512) against one stream, three configurations, three rounds.
#  3. The issue-13 serving command with the decode microbenchmark, --sweep-rounds 2. If the A/B found the
#     split slower (side/main median above 1 in two of its three configurations), this run sets
#     side_min_tokens out of reach, and says so in its log.
#  4. tests/models (HF + PEFT on CUDA) with what time is left.
# Usage: bash benchmarks/h200_session13_b.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 90 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_lora_side_delta.py \
  tests/kernels/test_lora_pdl.py tests/kernels/test_lora_kernels.py -k "side or pdl or start_lora" \
  > "$out/tests.txt" 2>&1
rc=$?
echo "kernel tests rc=$rc at ${SECONDS} s" | tee "$out/rc.txt"
if [ "$rc" -ne 0 ]; then tail -60 "$out/tests.txt"; exit 1; fi
timeout 120 python benchmarks/scripts/lora_prefill_side_ab.py --out "$out/prefill_ab.json" \
  > "$out/prefill_ab.txt" 2>&1
echo "prefill a/b rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep -v Warning "$out/prefill_ab.txt" | grep tokens
side_min=$(python - "$out/prefill_ab.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
    slower = sum(r["median_gpu_ms"]["side"] > r["median_gpu_ms"]["main"] for r in rows)
    print(1 << 30 if slower >= 2 else 512)
except Exception:
    print(512)
PY
)
echo "serving with SGMV side_min_tokens=$side_min" | tee -a "$out/rc.txt"
left=$((400 - SECONDS))
timeout "$left" python -c "
import sys
from mmlora.backends import triton_sgmv
triton_sgmv.TUNING['side_min_tokens'] = $side_min
from mmlora.bench.__main__ import main
sys.exit(main(sys.argv[1:]))
" serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 --num-requests 192 --hf-batch 0 \
  --sweep-rounds 2 --micro-batch 32 128 --allow-compiles --out "$out/rounds" > "$out/rounds.log" 2>&1
echo "rounds rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
python benchmarks/scripts/serving_summary.py "$out" rounds > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
left=$((470 - SECONDS))
timeout "$left" python -m pytest -q -p no:cacheprovider tests/models > "$out/tests_models.txt" 2>&1
echo "model tests rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
tail -3 "$out/tests_models.txt"
