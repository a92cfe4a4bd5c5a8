#!/usr/bin/env bash
# For the next session (written in session 40 after its device time was spent; not yet run). One call, about
# 150 s on a machine that has compiled the kernels once (add ~100 s on a fresh one): issue 13's 1000-adapter
# run (no micro-benchmark) under benchmarks/scripts/mixed_host_profile.py, which logs every mixed step's
# logits GEMM (seconds, rows, first time at that row count, current stream idle, upload stream busy).
# Session 40's profile (h100-2026-12-06-session40/p) put the 1000-adapter runs' extra mixed-step launch
# time in that one call, 9.4 ms a call against 0.1 ms base-only; this says whether it waits on a new shape
# (a kernel loaded lazily on first use can synchronize the context) or on the uploads.
# Usage: bash benchmarks/h200_session40_b.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 1000 --num-requests 192 --hf-batch 0 --micro-batch)
mkdir -p "$out/p"
echo "python benchmarks/scripts/mixed_host_profile.py p ${args[*]}" > "$out/command.txt"
timeout -s INT 400 python benchmarks/scripts/mixed_host_profile.py "$out/p" "${args[@]}" --out "$out/p/serving" \
  > "$out/p/log.txt" 2>&1
echo "profile rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
grep -ihE "Error|Traceback" "$out/p/log.txt" | head -8
for by in 4 6; do  # logits calls by first time at their row count, then by upload stream busy
  awk -v c=$by 'NR > 1 {k = $1 " " c "=" $c; n[k]++; s[k] += $2} END {for (k in n) printf "%s: %d calls, %.3f s\n", k, n[k], s[k]}' \
    "$out/p/logits.txt"
done
true
