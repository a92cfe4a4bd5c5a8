#!/usr/bin/env bash
# Session 27, after h200_session27_a.sh found run_expand_warps=4 faster at every decode-runs point (now the
# default): where a whole decode step's GPU time goes, base-only against LoRA (decode_graph_profile.py);
# the fused decode kernel (triton-fused: one launch a module) at serving's decode-runs composition against
# SGMV, with its launch knobs as modes.
# Usage: bash benchmarks/h200_session27_b.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
date -u > "$out/date.txt"
timeout 170 python benchmarks/scripts/decode_graph_profile.py --point 32:32 72:24 72:6 128:32 \
  --out "$out/profile.json" > "$out/profile.txt" 2>&1
echo "profile rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
pts=(decode-runs:72:24 decode-runs:72:6 decode-runs:128:32)
timeout 200 python benchmarks/scripts/decode_lora_anatomy.py --rounds 2 --backend triton-fused --point "${pts[@]}" \
  --mode c512:chunk=512 c2048:chunk=2048 c4096:chunk=4096 k64:block_k=64 k256:block_k=256 k512:block_k=512 \
  w8:warps=8 w2:warps=2 n256:block_n=256 s4:stages=4 c2048k256:chunk=2048,block_k=256 \
  c2048k512:chunk=2048,block_k=512 c4096k256:chunk=4096,block_k=256 c2048k256w8:chunk=2048,block_k=256,warps=8 \
  --profile-mode c2048k256 \
  --out "$out/fused.json" > "$out/fused.txt" 2>&1
echo "fused rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout 60 python benchmarks/scripts/decode_lora_anatomy.py --rounds 2 --point "${pts[@]}" \
  --out "$out/sgmv.json" > "$out/sgmv.txt" 2>&1
echo "sgmv rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep "^==" "$out/profile.txt" | cut -c1-300
grep -h "^==" "$out/fused.txt" "$out/sgmv.txt" | cut -c1-400
