#!/usr/bin/env bash
# Issue 13, the two questions session 7 left open (not yet run). One H200, bf16, dummy Mistral-7B, rank 16,
# one device call of about 7 minutes.
#  1. Where an adapter upload's 8-11 ms of host time go on the H200 (`benchmarks/scripts/upload_profile.py`:
#     host and GPU time per write_slot, and a torch.profiler table of one upload).
#  2. Eager steps ordered by adapter slot, A/B in one call: `bench serving` at 32 adapters, the default
#     code (A) alternating with `benchmarks/scripts/slot_ordered_eager.py` (B), twice each. Session 7
#     measured B's mixed steps slower across machine starts (1.54-1.80x base-only's mixed span, against
#     1.23-1.37x), which contradicts what B should do (fewer SGMV segments per mixed step).
# Usage: bash benchmarks/h200_next.sh OUTDIR      (then read OUTDIR/summary.txt)
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout 120 python benchmarks/scripts/upload_profile.py --num 8 > "$out/upload_profile.txt" 2>&1
echo "upload profile rc=$?" | tee "$out/rc.txt"
common=(--model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --micro-batch
  --allow-compiles)
for i in 1 2; do
  timeout 110 python -m mmlora.bench serving "${common[@]}" --out "$out/default$i" > "$out/default$i.log" 2>&1
  echo "default$i rc=$?" | tee -a "$out/rc.txt"
  timeout 90 python benchmarks/scripts/slot_ordered_eager.py serving "${common[@]}" --out "$out/ordered$i" \
    > "$out/ordered$i.log" 2>&1
  echo "ordered$i rc=$?" | tee -a "$out/rc.txt"
done
python benchmarks/scripts/serving_summary.py "$out" default1 ordered1 default2 ordered2 > "$out/summary.txt" 2>&1
head -12 "$out/upload_profile.txt" >> "$out/summary.txt"
cat "$out/summary.txt"
