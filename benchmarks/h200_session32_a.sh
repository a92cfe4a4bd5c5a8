#!/usr/bin/env bash
# Written in session 31; run in session 32 on an H100 (benchmarks/results/h100-2026-12-05-session32, c1). One
# call of about 560 s on the H200, the card the issues' targets name:
# 1. weight_layout_ab.py: the base linears' weights column-major (set_weight_layout) against row-major, in
#    real decode graphs at B=32, 72 and 128, base-only and on 24 adapters, two rounds. On the H100 a
#    pre-transposed weight made decode-shape GEMMs 1-7% faster at 12 of 15 points (session 31).
# 2. decode_knobs_ab.py: the four SGMV decode opt-ins, never timed on the H200 (on the H100 none won).
# 3. decode_attention_sweep.py: the decode attention's settings on the H200 (on the H100 the defaults won).
# A layout or knob becomes a default only where faster in both rounds at every batch; then issue 13's
# serving command with it, against the defaults, in the next call (``--weight-layout column-major`` for
# the layout, ``benchmarks/scripts/with_tuning.py`` for a knob).
# Usage: bash benchmarks/h200_session32_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out" artifacts/s32
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
date -u > "$out/date.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
timeout 230 python benchmarks/scripts/weight_layout_ab.py --batch 32 72 128 --adapters 24 --rounds 2 \
  --out "$out/layout_ab.json" > "$out/layout_ab.txt" 2>&1
echo "layout A/B rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
knobs4=shrink_pdl=true,run_expand_h_unroll=16,run_expand_group_b_first=true,run_shrink_k_per_split=1024
timeout $((470 - SECONDS)) python benchmarks/scripts/decode_knobs_ab.py --batch 72 128 --adapters 24 --rounds 2 \
  --mode spdl:shrink_pdl=true hu16:run_expand_h_unroll=16 "all4:$knobs4" \
  --out "$out/graphs_ab.json" > "$out/graphs_ab.txt" 2>&1
echo "graphs A/B rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
cp "$out/graphs_ab.json" artifacts/s32/ 2>/dev/null && python benchmarks/scripts/pick_knob_winners.py \
  artifacts/s32/graphs_ab.json
timeout $((575 - SECONDS)) python benchmarks/scripts/decode_attention_sweep.py --out "$out/attn_sweep.json" \
  --budget-s $((540 - SECONDS)) --compile-workers 8 > "$out/attn_sweep.txt" 2>&1
echo "attention sweep rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -iE "Error|Traceback" "$out/layout_ab.txt" "$out/graphs_ab.txt" "$out/attn_sweep.txt" | head -6
grep -h "^B=\|against rowmajor" "$out/layout_ab.txt" "$out/graphs_ab.txt" | cut -c1-330
grep -A9 "kernel configs by geomean ratio to the default over shapes (auto" "$out/attn_sweep.txt" | cut -c1-200
