#!/usr/bin/env bash
# Issue 23's rank mixes on session 24's opt-ins (written in session 25, which was lent no GPU; not yet run):
# 32 adapters of ranks {8}, {16}, {64}, {8, 64} in the default rank-64 pool, two rounds, each against its
# own round's base-only run, with mixed-step CUDA graphs on and the TUNING overrides given (as
# h200_session24_b.sh: e.g. triton-sgmv-norm:norm_expand=true where h200_session24_a.sh found it faster).
# Run it after h200_session24_a.sh and _b.sh, and only if _b.sh found the mixed-step graphs paying. A Triton
# compile inside a timed run fails the benchmark after its JSON is written (issue 23 asks it to assert none).
# Usage: bash benchmarks/h200_session25_c.sh OUTDIR [BACKEND:KNOB=JSON ...]
set -u
out=${1:?output folder}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
echo "overrides: ${*:-none}" | tee "$out/summary.txt"
timeout 540 python benchmarks/scripts/with_tuning.py "$@" -- serving --model dummy:mistral-7b-v0.3 \
  --num-adapters 32 --num-requests 192 --hf-batch 0 --rank-mixes 8 16 64 8,64 --pool-rank 64 \
  --sweep-rounds 2 --enable-mixed-cuda-graph --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -iE "captured|Error|Traceback" "$out/mixes.log" | head -8
grep "mmlora \|base-only ranks" "$out/mixes.log" | sed 's/.*run\/s\]//' | cut -c1-220
