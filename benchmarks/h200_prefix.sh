#!/usr/bin/env bash
# Issue 14 on one H200 (bf16, dummy Mistral-7B, 32 rank-16 adapters): the prefix cache on against off.
# Usage: bash benchmarks/h200_prefix.sh OUTDIR        (about 4 minutes; one device call)
#   run 1, --max-running-requests 128 (the conditions of the session-3 figures, 1.86-1.94x):
#          shared-prefix (256 requests, 1024-token system prompt per adapter, 64 in / 128 out) and the
#          no-sharing workload; each: untimed warm-up, then two on/off pairs, on first then off first.
#   run 2, --max-running-requests 256: the shared-prefix workload alone, so its 256 requests run in one
#          wave for the cache on and off alike (at 128 the TTFT p50 falls between two waves).
# Writes OUTDIR/cap128/serving_prefix.json, OUTDIR/cap256/serving_prefix.json (each timed run with its
# step breakdown), the logs, and OUTDIR/summary.txt (per pair ratios, worse pair against the targets).
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
common=(--workload shared-prefix --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 256
        --shared-prefix 1024 64 128 --repeats 2)
timeout 170 python -m mmlora.bench serving "${common[@]}" --max-running-requests 128 \
  --out "$out/cap128" > "$out/cap128.log" 2>&1
echo "cap128 rc=$?" | tee "$out/rc.txt"
timeout 110 python -m mmlora.bench serving "${common[@]}" --max-running-requests 256 \
  --prefix-workloads shared-prefix --out "$out/cap256" > "$out/cap256.log" 2>&1
echo "cap256 rc=$?" | tee -a "$out/rc.txt"
python benchmarks/scripts/prefix_summary.py "$out" cap128 cap256 > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
