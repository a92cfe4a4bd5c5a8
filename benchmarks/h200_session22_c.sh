#!/usr/bin/env bash
# Session 22, call 4: the fused activation's tests (GPU check within a few ulp of the unfused path), then
# launch settings swept on one layer's gate_up (call 3: at 16-token tiles the fused kernel was 1.5-1.7x the
# expand + activation, [16, 256] fp32 tiles x4 per program), the fastest over decode runs picked, and decode
# graphs recaptured both ways with it.
# Usage: bash benchmarks/h200_session22_c.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 100 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_act_expand.py > "$out/tests_act.txt" 2>&1
echo "act tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests_act.txt")" | tee "$out/summary.txt"
timeout 150 python benchmarks/scripts/act_expand_kernels.py --rounds 3 --out "$out/act_kernels.json" \
  --pick-into "$out/picked.json" --variants '{"run_block_n": 64, "run_group": 8}' \
  '{"run_block_n": 128, "run_group": 4}' '{"run_block_n": 64, "run_group": 8, "run_warps": 2}' \
  '{"run_block_n": 128, "run_group": 2, "run_warps": 2}' '{"run_block_n": 64, "run_group": 4, "stages": 3}' \
  '{"run_block_n": 32, "run_group": 16}' '{"run_block_n": 64, "run_group": 8, "max_split": 1}' \
  '{"block_n": 64, "group": 4, "warps": 4}' > "$out/act_kernels.txt" 2>&1
echo "kernels rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
MMLORA_ACT_TUNING="$out/picked.json" timeout $((420 - SECONDS)) python benchmarks/scripts/act_expand_ab.py \
  --batch 64 128 --rounds 2 --out "$out/graphs_ab.json" > "$out/graphs_ab.txt" 2>&1
echo "graphs rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -E "^(FAILED|E  )" "$out/tests_act.txt" | head -10
grep -v Warning "$out/act_kernels.txt" | tail -7
grep "B=\|settings" "$out/graphs_ab.txt" | grep -v adapters
