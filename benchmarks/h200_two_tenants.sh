#!/usr/bin/env bash
# Issue 20 on one H200 (bf16, dummy Mistral-7B weights): vtc against fcfs on the two-tenants workload.
# Usage: bash benchmarks/h200_two_tenants.sh OUTDIR      (about 3 minutes; a 235 s limit)
# One process: capacity C measured first (output tok/s, saturated), then a heavy adapter at 1.1 x C and
# 7 light ones at C/10 each, Poisson, 12 s of arrivals per run (a run lasts at most 24 s); fcfs then vtc on fresh engines, twice.
# Writes OUTDIR/serving_tenants.json (per run: light TTFT/latency p50/p99, heavy TTFT, tok/s, slot loads;
# per round: vtc/fcfs ratios; worse_round, ratios = the worst of each), two_tenants.log and summary.txt.
# Targets (issue 20): light TTFT p99 vtc/fcfs <= 0.3, throughput vtc/fcfs >= 0.95.
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 235 python -m mmlora.bench serving --workload two-tenants --model dummy:mistral-7b-v0.3 \
  --heavy-load 1.1 --duration 12 --rounds 2 --input-len 32 256 --output-len 16 128 --max-model-len 512 \
  --ranks 16 --out "$out" > "$out/two_tenants.log" 2>&1
rc=$?
{
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
  echo "two-tenants rc=$rc after ${SECONDS}s"
  tr '\r' '\n' < "$out/two_tenants.log" | grep -E "capacity:|^round [0-9]|^worse round|Error|error" | tail -20
} > "$out/summary.txt"
cat "$out/summary.txt"
