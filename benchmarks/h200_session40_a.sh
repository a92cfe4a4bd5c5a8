#!/usr/bin/env bash
# For the next session (written in session 40 after its device time was spent; not yet run). One call, about
# 560 s:
# 1. p/: issue 13's 1000-adapter run under benchmarks/scripts/mixed_host_profile.py, which now logs every
#    mixed step's logits GEMM (seconds, rows, first time at that row count, current stream idle, upload
#    stream busy). Session 40's profile (h100-2026-12-06-session40/p) put the 1000-adapter runs' extra
#    mixed-step launch time in that one call, 9.4 ms a call against 0.1 ms base-only; this says whether it
#    waits on a new shape (a kernel loaded lazily on first use can synchronize the context) or on uploads.
# 2. serving/ against knobs/: issue 23's rank mixes {64} and {8, 64}, defaults against
#    --lora-stage-slots 32 with stage:min_rows_per_adapter=1.5, the stage arm that session 40's issue 13
#    A/B left level or ahead at every adapter count (a/): with 32 positions a rank-64 adapter takes four,
#    so a batch of 32 rank-64 adapters does not fit and only the KV cache's 1.2 GB should differ.
# Usage: bash benchmarks/h200_session40_a.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
timeout -s INT 150 python benchmarks/scripts/mixed_host_profile.py "$out/p" serving --model dummy:mistral-7b-v0.3 \
  --num-adapters 1000 --num-requests 192 --hf-batch 0 --out "$out/p/serving" > "$out/p/log.txt" 2>&1
echo "profile rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --pool-rank 64
  --rank-mixes 64 8,64 --sweep-rounds 2)
{
  echo "python benchmarks/scripts/mixed_host_profile.py p serving --model dummy:mistral-7b-v0.3 --num-adapters 1000 --num-requests 192 --hf-batch 0"
  echo "python -m mmlora.bench ${args[*]}"
  echo "python benchmarks/scripts/with_tuning.py stage:min_rows_per_adapter=1.5 -- ${args[*]} --lora-stage-slots 32"
} > "$out/command.txt"
timeout $(((590 - SECONDS) / 2)) python -m mmlora.bench "${args[@]}" --out "$out/serving" > "$out/serving.log" 2>&1
echo "defaults rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((590 - SECONDS)) python benchmarks/scripts/with_tuning.py stage:min_rows_per_adapter=1.5 -- "${args[@]}" \
  --lora-stage-slots 32 --out "$out/knobs" > "$out/knobs.log" 2>&1
echo "stage rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -ihE "Error|Traceback" "$out"/*.log "$out"/p/log.txt | head -8
for by in 4 6; do  # logits calls by first time at their row count, then by upload stream busy
  awk -v c=$by 'NR > 1 {k = $1 " " c "=" $c; n[k]++; s[k] += $2} END {for (k in n) printf "%s: %d calls, %.3f s\n", k, n[k], s[k]}' \
    "$out/p/logits.txt"
done
python benchmarks/scripts/serving_summary.py "$out" serving knobs 2>&1 | head -40
true
