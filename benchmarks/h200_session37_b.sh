#!/usr/bin/env bash
# Session 37, call 2: issue 23's rank mixes with the staged shrink on CUDA's default pool (rank 64 paged by
# 16, where a stage position is one page: a rank-8 adapter takes one, a rank-64 one four). Two sweep rounds
# each:
# 1. the defaults, --rank-mixes 64 and 8,64 in one run (one base-only run per round);
# 2. {64} with --lora-stage-slots 128 (32 rank-64 adapters: 4 pages each);
# 3. {8, 64} with --lora-stage-slots 80 (16 rank-8 adapters at one page, 16 rank-64 at four).
# Usage: bash benchmarks/h200_session37_b.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --pool-rank 64
  --sweep-rounds 2)
{
  echo "python -m mmlora.bench ${args[*]} --rank-mixes 64 8,64"
  echo "python -m mmlora.bench ${args[*]} --rank-mixes 64 --lora-stage-slots 128"
  echo "python -m mmlora.bench ${args[*]} --rank-mixes 8,64 --lora-stage-slots 80"
} > "$out/command.txt"
timeout $(((590 - SECONDS) * 2 / 5)) python -m mmlora.bench "${args[@]}" --rank-mixes 64 8,64 --out "$out/serving" \
  > "$out/serving.log" 2>&1
echo "defaults rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
timeout $(((590 - SECONDS) / 2)) python -m mmlora.bench "${args[@]}" --rank-mixes 64 --lora-stage-slots 128 \
  --out "$out/staged64" > "$out/staged64.log" 2>&1
echo "staged {64} rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((585 - SECONDS)) python -m mmlora.bench "${args[@]}" --rank-mixes 8,64 --lora-stage-slots 80 \
  --out "$out/staged_mix" > "$out/staged_mix.log" 2>&1
echo "staged {8, 64} rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -ihE "Error|Traceback" "$out"/*.txt "$out"/*.log | head -8
python benchmarks/scripts/serving_summary.py "$out" serving staged64 staged_mix 2>&1 | head -70
true
