#!/usr/bin/env bash
# Issue 13, the next device call (not yet run). One H200, bf16, dummy Mistral-7B, rank 16, about 8 minutes.
# Session 8 found serving runs 10-25% apart from run to run (base-only alone at 6504 and 5279 tok/s in one
# call, its mixed steps' GPU span 2.20 against 3.03 s), so ratios from two separate processes settle
# little. This call:
#  1. logs the GPU's SM clock, power and temperature every 0.5 s in the background (gpu_log.csv), to
#     see whether the GPU side of that spread follows the clocks;
#  2. runs the serving command with --sweep-rounds 2 in one process: base-only, 8, 32, 1000
#     adapters, then all four again, each LoRA point against its own round's base-only run (every run
#     starts from an empty prefix cache since session 8);
#  3. (after the sweep, if time is left) the decode microbenchmark;
#  4. (if time is left) benchmarks/scripts/upload_profile.py: the first write into each slot against a
#     repeated one (session 8 builds every slot's upload plan at load time; unmeasured on the GPU).
# Usage: bash benchmarks/h200_next.sh OUTDIR      (then read OUTDIR/summary.txt)
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 500 > "$out/gpu_log.csv" 2>&1 &
logger=$!
timeout 420 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
  --num-requests 192 --hf-batch 0 --sweep-rounds 2 --allow-compiles --out "$out/rounds" > "$out/rounds.log" 2>&1
echo "rounds rc=$?" | tee "$out/rc.txt"
if [ "$SECONDS" -lt 440 ]; then
  timeout 90 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 8 \
    --hf-batch 0 --micro-batch 32 128 --micro-adapters 32 --allow-compiles --out "$out/micro" > "$out/micro.log" 2>&1
  echo "micro rc=$?" | tee -a "$out/rc.txt"
fi
if [ "$SECONDS" -lt 500 ]; then
  timeout 80 python benchmarks/scripts/upload_profile.py --num 8 > "$out/upload_profile.txt" 2>&1
  echo "upload profile rc=$?" | tee -a "$out/rc.txt"
fi
kill "$logger" 2>/dev/null
python benchmarks/scripts/serving_summary.py "$out" rounds micro > "$out/summary.txt" 2>&1
grep -E "first write|write_slot|H2D" "$out/upload_profile.txt" >> "$out/summary.txt" 2>/dev/null
cat "$out/summary.txt"
