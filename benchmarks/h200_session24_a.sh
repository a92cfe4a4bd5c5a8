#!/usr/bin/env bash
# Two opt-in changes of session 24, timed (written in session 24, whose one device call was lost with its
# machine before it returned anything; not yet run):
#  1. CUDA graphs for prefill and mixed steps (mmlora.engine.mixed_graph; --enable-mixed-cuda-graph);
#  2. o_proj's and down_proj's SGMV expand fused into the next RMSNorm (triton_sgmv_norm norm_expand).
# Steps: both GPU test files; the norm fusion's decode-graph A/B (B=64, 128 on 32 adapters, two rounds,
# rotating order); issue 13's serving command with mixed graphs on (8 / 32 / 1000 adapters, decode
# micro-benchmark, two rounds), and with the norm fusion on too where the A/B found it faster in every
# round; the 32-adapter run with everything off (the defaults), two rounds.
# Usage: bash benchmarks/h200_session24_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
timeout 130 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_mixed_graph.py \
  tests/kernels/test_norm_expand.py > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
timeout 110 python benchmarks/scripts/norm_expand_ab.py --batch 64 128 --rounds 2 --out "$out/norm_ab.json" \
  > "$out/norm_ab.log" 2>&1
echo "norm A/B rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
norm=$(python - "$out/norm_ab.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
    wins = [r["fused"]["replay_ms"] < r["expand"]["replay_ms"] for row in rows for r in row["rounds"]]
    ok = bool(wins) and all(wins) and all(row["same_tokens_and_logprobs"] for row in rows)
except Exception:
    ok = False
print("triton-sgmv-norm:norm_expand=true" if ok else "")
PY
)
echo "norm fusion in the serving run: ${norm:-off}" | tee -a "$out/summary.txt"
timeout 250 python benchmarks/scripts/with_tuning.py $norm -- serving --model dummy:mistral-7b-v0.3 \
  --num-adapters 8 32 1000 --num-requests 192 --hf-batch 0 --micro-batch 32 128 --sweep-rounds 2 \
  --enable-mixed-cuda-graph --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((560 - SECONDS)) python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 \
  --num-requests 192 --hf-batch 0 --sweep-rounds 2 --out "$out/serving_off" > "$out/serving_off.log" 2>&1
echo "serving off rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR|E  )" "$out/tests.txt" | head -8
grep -E "^B=" "$out/norm_ab.log" | cut -c1-220
grep -iE "captured|Error|Traceback" "$out/serving.log" | head -8
for f in serving serving_off; do grep "mmlora \|base-only ranks\|decode step\|mixed  " "$out/$f.log" | sed 's/.*run\/s\]//' | cut -c1-200; done
