#!/usr/bin/env bash
# For the next session (written in session 42 after its device time was spent; not yet run). One call, about
# 590 s: issue 23's rank mixes {64} and {8, 64} with the defaults (lora_stage_slots auto: serving/) against
# the stage off (off/). On an 80 GB H100 auto leaves the stage off beside the bench's 128 rank-64 slots
# (h100-2026-12-06-session42/a/memory_r64.json), so both arms build the same engine there; on a 141 GB H200
# the KV cache is large enough that auto stages, and this shows what that costs or gains the mixes.
# Usage: bash benchmarks/h200_session42_b.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --pool-rank 64
  --rank-mixes 64 8,64 --sweep-rounds 2)
extra=(--lora-stage-slots 0)
source "$(dirname "$0")/serving_ab.sh"
grep -ihE "Error|Traceback" "$out"/*.log | head -8
python benchmarks/scripts/serving_summary.py "$out" serving off 2>&1 | head -40
true
