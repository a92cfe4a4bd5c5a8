#!/usr/bin/env bash
# For the next session with a GPU (written in session 29, which was lent none when it began; not yet run).
# One call that judges every untimed decode-latency opt-in of SGMV where serving spends its LoRA time, the
# decode graphs (session 27: +1.84 ms a step at 72 rows on 24 adapters, 256 short kernels):
#   spdl   shrink_pdl: the shrink a programmatic dependent of the base GEMM (session 27)
#   hu16   run_expand_h_unroll=16: h's split-K planes summed with unrolled loads (session 28)
#   bf     run_expand_group_b_first: a grouped expand's first B tile before the PDL wait (session 28)
#   k1024  run_shrink_k_per_split=1024: down's shrink split 14 ways instead of 8 (session 29)
#   all3 / all4: together (without / with k1024)
# 1. Their GPU tests: the PDL chains with the knobs on against plain launches and float64, eager and in
#    graph replays; the warm-up covering every variant; the kernels against the reference.
# 2. decode_knobs_ab.py: real decode graphs of one engine (dummy Mistral-7B, 24 rank-16 adapters), B=72 (serving's
#    mean decode batch) and 128, every mode recaptured and timed as replay and engine step, two rounds in a
#    rotating order, and each mode's greedy tokens and logprobs against the defaults'.
# 3. decode_lora_anatomy.py: the same knobs per kernel and module (eager), so a win can be traced.
# A knob becomes a default only where it is faster in both rounds at both batches with the same tokens; then
# h200_session28_c.sh (with the winners as its knobs) times issue 13's serving command.
# Usage: [BUDGET=S] bash benchmarks/h200_session29_a.sh OUTDIR (BUDGET: seconds for the whole, 585 by default;
# the graphs A/B ends 115 s before it, leaving the anatomy what remains)
set -u
out=${1:?output folder}
budget=${BUDGET:-585}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
date -u > "$out/date.txt"
git log -1 --format=%H > "$out/commit.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
timeout 150 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_pdl.py \
  tests/kernels/test_lora_warmup.py tests/kernels/test_lora_kernels.py tests/kernels/test_sgmv_run_knobs.py \
  -k "pdl or warm or h_unroll or run_expand_groups or k_per_split" > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
knobs3=shrink_pdl=true,run_expand_h_unroll=16,run_expand_group_b_first=true
modes=(spdl:shrink_pdl=true hu16:run_expand_h_unroll=16 bf:run_expand_group_b_first=true
  k1024:run_shrink_k_per_split=1024 "all3:$knobs3" "all4:$knobs3,run_shrink_k_per_split=1024")
timeout $((budget - 115 - SECONDS)) python benchmarks/scripts/decode_knobs_ab.py --batch 72 128 --adapters 24 \
  --rounds 2 --mode "${modes[@]}" --out "$out/graphs_ab.json" > "$out/graphs_ab.txt" 2>&1
echo "graphs A/B rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
amodes=(hu16:run_expand_h_unroll=16 bf:run_expand_group_b_first=true k1024:run_shrink_k_per_split=1024
  hu16bf:run_expand_h_unroll=16,run_expand_group_b_first=true
  hu16bfk1024:run_expand_h_unroll=16,run_expand_group_b_first=true,run_shrink_k_per_split=1024)
timeout $((budget - SECONDS)) python benchmarks/scripts/decode_lora_anatomy.py --rounds 2 --mode "${amodes[@]}" \
  --profile-mode default hu16bfk1024 --point decode-runs:72:24:runs decode-runs:128:32:runs \
  --out "$out/anatomy_r16.json" > "$out/anatomy_r16.txt" 2>&1
echo "anatomy rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR)" "$out/tests.txt" | head -8
grep -iE "Error|Traceback" "$out/graphs_ab.txt" | head -5
grep -h "^B=" "$out/graphs_ab.txt" | cut -c1-400
grep -h "^==" "$out/anatomy_r16.txt" | cut -c1-400
