#!/usr/bin/env bash
# Ran in session 33 at commit 98d94ff (benchmarks/results/h200-2026-12-05-session33/c2); the knob was removed after.
# Session 33, second call (about 520 s): the summing shrink (``run_shrink_reduce``) only where it paid in
# the first call, the expands of more than one rank step in at least 8 programs per SM (rank-64 gate_up at
# serving's decode runs). 1. decode_lora_anatomy.py at rank 64 (paged by 16) and rank 16, mode red8, to see
# which kernels change; 2. issue 23's {64} run (32 adapters, rank-64 pool, two rounds against base-only),
# with the defaults and then with the knob (with_tuning.py), on one card.
# Usage: bash benchmarks/h200_session33_c.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
timeout 60 python benchmarks/scripts/decode_lora_anatomy.py --rounds 2 --mode red8:run_shrink_reduce=8 \
  --profile-mode default red8 --rank 64 --page-rank 16 --point decode-runs:72:24:runs decode-runs:128:32:runs \
  --out "$out/anatomy_r64.json" > "$out/anatomy_r64.txt" 2>&1
echo "anatomy rank 64 rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --rank-mixes 64
  --pool-rank 64 --sweep-rounds 2)
echo "python -m mmlora.bench ${args[*]}" > "$out/command.txt"
echo "python benchmarks/scripts/with_tuning.py triton-sgmv:run_shrink_reduce=8 -- ${args[*]}" >> "$out/command.txt"
timeout 250 python -m mmlora.bench "${args[@]}" --out "$out/default" > "$out/default.log" 2>&1
echo "{64} defaults rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((580 - SECONDS)) python benchmarks/scripts/with_tuning.py triton-sgmv:run_shrink_reduce=8 -- "${args[@]}" \
  --out "$out/red8" > "$out/red8.log" 2>&1
echo "{64} red8 rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -ihE "Error|Traceback" "$out"/*.log | head -6
grep -h "^==" "$out/anatomy_r64.txt" | cut -c1-300
for r in default red8; do echo "== $r"; grep "mmlora \|base-only ranks\|compile" "$out/$r.log" | sed 's/.*run\/s\]//' | cut -c1-220; done
true
