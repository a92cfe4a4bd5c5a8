#!/usr/bin/env bash
# Session 9, call 4 (one H200), under 9 minutes: adapter loads beside the forwards (issue 13 item 4).
#  1. GPU tests: loads on the upload stream against loads on the main stream, the engine with and without
#     them (same tokens), and the Llama family against HF + PEFT with the default (beside) loads.
#  2. The serving command, --sweep-rounds 2, in one process, default settings (loads beside the
#     forwards, the LoRA shrink beside the base GEMM): each LoRA point against its own round's base-only.
#  3. If time is left: 32 and 1000 adapters with --disable-async-uploads, one round (loads on the main
#     stream, as in call 1), for a look at what the loads cost.
# Usage: bash benchmarks/h200_session9_uploads.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 100 python -m pytest -q -p no:cacheprovider -x tests/unit/test_slot_loads_beside.py tests/unit/test_pool.py \
  "tests/models/test_llama_family_vs_peft.py" > "$out/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" | tee "$out/rc.txt"
timeout 300 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
  --num-requests 192 --hf-batch 0 --sweep-rounds 2 --allow-compiles --out "$out/rounds" > "$out/rounds.log" 2>&1
echo "rounds rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
if [ "$SECONDS" -lt 390 ]; then
  timeout 150 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 1000 \
    --num-requests 192 --hf-batch 0 --disable-async-uploads --allow-compiles --out "$out/sync" > "$out/sync.log" 2>&1
  echo "sync rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
fi
python benchmarks/scripts/serving_summary.py "$out" rounds sync > "$out/summary.txt" 2>&1
tail -4 "$out/gpu_tests.txt"
cat "$out/summary.txt"
