#!/usr/bin/env bash
# Session 41, one call of about 590 s: issue 23's rank mixes {64} and {8, 64} with the shrink stage (32
# positions, stage:min_rows_per_adapter 1.5, the default now: serving/) against no stage (off/). Session 41
# ran it on a tree that made the stage the CUDA default (lora_stage_slots None -> 32, never committed), so
# serving/ took no --lora-stage-slots; at d29be6a and later the stage arm names it. Session 40's issue 13
# A/B of the same two arms (h100-2026-12-06-session40/a) left the stage level or ahead at 8, 32 and 1000
# adapters. A rank-64 adapter takes four of the 32 positions, so a batch of 32 rank-64 adapters does not
# fit the stage and mostly only the KV cache differs.
# Usage: bash benchmarks/h200_session41_a.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --pool-rank 64
  --rank-mixes 64 8,64 --sweep-rounds 2)
echo "python -m mmlora.bench ${args[*]} --lora-stage-slots 32" >> "$out/command.txt"
echo "python -m mmlora.bench ${args[*]} --lora-stage-slots 0" >> "$out/command.txt"
timeout $(((590 - SECONDS) / 2)) python -m mmlora.bench "${args[@]}" --lora-stage-slots 32 --out "$out/serving" \
  > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((590 - SECONDS)) python -m mmlora.bench "${args[@]}" --lora-stage-slots 0 --out "$out/off" \
  > "$out/off.log" 2>&1
echo "serving with --lora-stage-slots 0 rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -ihE "Error|Traceback" "$out"/*.log | head -8
python benchmarks/scripts/serving_summary.py "$out" serving off 2>&1 | head -40
true
