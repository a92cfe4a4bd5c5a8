#!/usr/bin/env bash
# Ran in session 33 at commit ed75a96 (benchmarks/results/h200-2026-12-05-session33/c1); the knob was removed after.
# Session 33, first call (about 300 s): the decode-run shrink that sums its own split-K planes
# (``run_shrink_reduce``), so each expand program reads one plane of h instead of about 8.
# 1. its GPU tests (real atomics, compiled kernels), with the other run knobs' tests;
# 2. decode_lora_anatomy.py at serving's decode runs, rank 16 and rank 64 (paged by 16), modes red
#    (the knob), hu16 (run_expand_h_unroll=16, the unrolled plane sum, never timed at rank 64), both;
# 3. decode_knobs_ab.py: the knob in real decode graphs, B=72 and 128 on 24 adapters, rank 16 and rank
#    64, two rounds, with the greedy tokens and logprobs against the default (must be bit-equal).
# A knob becomes a default only where faster in both rounds at every batch.
# Usage: bash benchmarks/h200_session33_a.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
cat "$out/gpu.txt"
timeout 120 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_sgmv_run_knobs.py -k "reduce or h_unroll" \
  > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
modes=(red:run_shrink_reduce=true hu16:run_expand_h_unroll=16 redhu:run_shrink_reduce=true,run_expand_h_unroll=16)
timeout 120 python benchmarks/scripts/decode_lora_anatomy.py --rounds 2 --mode "${modes[@]}" --profile-mode default red \
  --point decode-runs:72:24 decode-runs:72:24:runs decode-runs:128:32:runs \
  --out "$out/anatomy_r16.json" > "$out/anatomy_r16.txt" 2>&1
echo "anatomy rank 16 rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout 120 python benchmarks/scripts/decode_lora_anatomy.py --rounds 2 --mode "${modes[@]}" --profile-mode default red \
  --rank 64 --page-rank 16 --point decode-runs:72:24:runs decode-runs:128:32:runs \
  --out "$out/anatomy_r64.json" > "$out/anatomy_r64.txt" 2>&1
echo "anatomy rank 64 rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
for rank in 16 64; do
  timeout $((560 - SECONDS)) python benchmarks/scripts/decode_knobs_ab.py --batch 72 128 --adapters 24 --rounds 2 \
    --rank $rank --mode red:run_shrink_reduce=true --out "$out/graphs_r$rank.json" > "$out/graphs_r$rank.txt" 2>&1
  echo "graphs A/B rank $rank rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
done
grep -ihE "Error|Traceback" "$out"/*.txt | head -6
grep -h "^==" "$out/anatomy_r16.txt" "$out/anatomy_r64.txt" | cut -c1-300
grep -h "^B=\|against" "$out"/graphs_r*.txt | cut -c1-300
true
