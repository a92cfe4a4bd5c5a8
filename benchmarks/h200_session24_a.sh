#!/usr/bin/env bash
# Session 24's two opt-ins on a GPU, part 1 of 2 (written in session 24, whose one device call was lost with
# its machine before it returned anything; not yet run):
#  1. CUDA graphs for prefill and mixed steps (mmlora.engine.mixed_graph; --enable-mixed-cuda-graph);
#  2. o_proj's and down_proj's SGMV expand fused into the next RMSNorm (triton_sgmv_norm norm_expand).
# Here: both GPU test files (and, since session 25, the slot-load tests: registering an adapter now loads it
# into a free slot on the upload stream), then the norm fusion's decode-graph A/B (B=64, 128 on 32 adapters, two rounds,
# rotating order). Part 2 (h200_session24_b.sh) is the serving run; pass it
# triton-sgmv-norm:norm_expand=true if this A/B finds the fusion faster in every round, same tokens.
# Usage: bash benchmarks/h200_session24_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
timeout 200 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_mixed_graph.py \
  tests/kernels/test_norm_expand.py tests/unit/test_slot_loads_beside.py > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
timeout 150 python benchmarks/scripts/norm_expand_ab.py --batch 64 128 --rounds 2 --out "$out/norm_ab.json" \
  > "$out/norm_ab.log" 2>&1
echo "norm A/B rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR|E  )" "$out/tests.txt" | head -8
grep -E "^B=" "$out/norm_ab.log" | cut -c1-220
