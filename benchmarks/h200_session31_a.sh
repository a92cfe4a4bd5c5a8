#!/usr/bin/env bash
# Session 31's first call (about 580 s; written when failed machine starts had left about 1,400 s of device
# time, so the three measurements that decide something share one call):
# 1. decode_attention_sweep.py: the Triton decode attention's launch settings (block_n x warps x stages x
#    splits) at serving's decode shapes, two rounds, outputs checked against the defaults' (140 s budget).
#    This commit also skips the reduce launch where a decode has one split (B >= 72 in serving's graphs).
# 2. decode_gemm_probe.py: decode-shape base GEMMs, F.linear against a pre-transposed weight and a Triton
#    skinny GEMM (60 s budget): is base-only decode's GEMM time (3.99 of 5.51 ms at B=32) reducible?
# 3. decode_knobs_ab.py: the untimed SGMV decode knobs (shrink_pdl, run_expand_h_unroll=16,
#    run_shrink_k_per_split=1024, and all four with run_expand_group_b_first) in real decode graphs at B=72
#    and 128 on 24 adapters, two rounds, with each mode's tokens against the defaults'. The A/B is kept in
#    artifacts/s31/ (ignored by git, kept on the warm machine) for a follow-up call; none won, and
#    session 31's follow-up calls (issue 13's command, GPU tests) are in its results README.
# Usage: bash benchmarks/h200_session31_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out" artifacts/s31
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
date -u > "$out/date.txt"
git log -1 --format=%H > "$out/commit.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
timeout 170 python benchmarks/scripts/decode_attention_sweep.py --out "$out/attn_sweep.json" --budget-s 140 \
  --compile-workers 8 > "$out/attn_sweep.txt" 2>&1
echo "attention sweep rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
timeout 80 python benchmarks/scripts/decode_gemm_probe.py --out "$out/gemm.json" --budget-s 60 \
  > "$out/gemm.txt" 2>&1
echo "gemm probe rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
knobs4=shrink_pdl=true,run_expand_h_unroll=16,run_expand_group_b_first=true,run_shrink_k_per_split=1024
timeout $((575 - SECONDS)) python benchmarks/scripts/decode_knobs_ab.py --batch 72 128 --adapters 24 --rounds 2 \
  --mode spdl:shrink_pdl=true hu16:run_expand_h_unroll=16 k1024:run_shrink_k_per_split=1024 "all4:$knobs4" \
  --out "$out/graphs_ab.json" > "$out/graphs_ab.txt" 2>&1
echo "graphs A/B rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
cp "$out/graphs_ab.json" artifacts/s31/ 2>/dev/null && python benchmarks/scripts/pick_knob_winners.py \
  artifacts/s31/graphs_ab.json
grep -iE "Error|Traceback" "$out/attn_sweep.txt" "$out/gemm.txt" "$out/graphs_ab.txt" | head -6
grep -v -i warn "$out/gemm.txt" | grep "round" | cut -c1-200
grep -h "^B=" "$out/graphs_ab.txt" | cut -c1-330
tail -45 "$out/attn_sweep.txt" | cut -c1-200
