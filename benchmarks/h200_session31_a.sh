#!/usr/bin/env bash
# Session 31's first call: the decode-shape GEMM probe (decode_gemm_probe.py: F.linear against a
# pre-transposed weight and a Triton skinny GEMM, for base-only decode over its floor), then
# h200_session29_a.sh shortened to BUDGET=465 (the four untimed SGMV decode knobs: GPU tests, the graphs
# A/B at B=72 and 128 on 24 adapters, two rounds, and the per-kernel anatomy). The A/B is kept in
# artifacts/s31/ (ignored by git, kept on the warm machine) for h200_session31_b.sh.
# Usage: bash benchmarks/h200_session31_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out" artifacts/s31
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$PWD timeout 110 python benchmarks/scripts/decode_gemm_probe.py --out "$out/gemm.json" --budget-s 95 \
  > "$out/gemm.txt" 2>&1
echo "gemm probe rc=$?"
grep -v -i warn "$out/gemm.txt" | cut -c1-220
BUDGET=465 timeout 475 bash benchmarks/h200_session29_a.sh "$out"
cp "$out/graphs_ab.json" artifacts/s31/ 2>/dev/null && PYTHONPATH=$PWD python benchmarks/scripts/pick_knob_winners.py \
  artifacts/s31/graphs_ab.json
