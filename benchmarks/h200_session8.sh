#!/usr/bin/env bash
# Session 8, first device call (one H200, bf16, dummy Mistral-7B, rank 16; about 7 minutes).
#  1. Issue 13: where an adapter upload's 8-11 ms go (benchmarks/scripts/upload_profile.py: the staged
#     blocks' page-locking, the host-to-device link from page-locked and pageable memory, host and GPU
#     time per write_slot, a profiler table of one upload).
#  2. Issue 14: the prefix cache on against off at 256 running requests, for the shared-prefix workload
#     and the no-sharing workload, two on/off pairs each in alternating order (benchmarks/h200_prefix.sh
#     ran the no-sharing workload only at 128).
# Usage: bash benchmarks/h200_session8.sh OUTDIR      (then read OUTDIR/summary.txt)
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
timeout 120 python benchmarks/scripts/upload_profile.py --num 8 > "$out/upload_profile.txt" 2>&1
echo "upload profile rc=$?" | tee "$out/rc.txt"
timeout 300 python -m mmlora.bench serving --workload shared-prefix --model dummy:mistral-7b-v0.3 \
  --num-adapters 32 --num-requests 256 --shared-prefix 1024 64 128 --repeats 2 --max-running-requests 256 \
  --out "$out/cap256" > "$out/cap256.log" 2>&1
echo "cap256 rc=$?" | tee -a "$out/rc.txt"
python benchmarks/scripts/prefix_summary.py "$out" cap256 > "$out/summary.txt" 2>&1
head -16 "$out/upload_profile.txt" >> "$out/summary.txt"
cat "$out/summary.txt"
# 3. Issues 13 and 23: the Triton backends' launch heuristics, one knob at a time, on the decode-graph
#    (runs and rows layouts) and prefill batches serving launches.
timeout 300 python benchmarks/scripts/lora_tuning_sweep.py --out "$out/sweep.json" > "$out/sweep.txt" 2>&1
echo "sweep rc=$?" | tee -a "$out/rc.txt"
cat "$out/sweep.txt" >> "$out/summary.txt"
