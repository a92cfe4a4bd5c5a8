#!/usr/bin/env bash
# Session 34, first call (about 400 s): two decode-latency changes of SGMV's decode runs, both off by default.
#   as     act_shrink: down's shrink fused into the gated activation (one launch for both)
#   asp    ... with down's expand a programmatic dependent of down's base GEMM (act_shrink_expand_pdl)
#   g1     run_expand_group=1 (every expand one column tile a program)
#   gp800 / gp1200  run_expand_group_programs: per launch the largest group of 4 / 2 / 1 keeping that many
#          programs (gate_up in groups of 4, o and down of 1 at serving's B=72)
#   asgp   act_shrink with gp800
# 1. Their GPU tests (the fused kernel eager and in CUDA graphs, the warm-up, the group rule).
# 2. decode_knobs_ab.py: real decode graphs (dummy Mistral-7B, 24 rank-16 adapters), B=72 and 128, every mode
#    recaptured and timed as replay and engine step, two rounds in a rotating order, tokens against the defaults'.
# 3. decode_lora_anatomy.py: the expand groups per kernel at B=72 on 24 and B=128 on 32 (segment entries
#    B // 2, as graphs capture them), and where a mixed step's and a prefill's LoRA time goes (defaults).
# A mode becomes a default only where it is faster in both rounds at both batches; then issue 13's serving
# command runs with it (h200_session33_b.sh with KNOBS).
# Usage: bash benchmarks/h200_session34_a.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
timeout 150 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_act_shrink.py \
  tests/kernels/test_lora_warmup.py tests/kernels/test_sgmv_run_knobs.py -k "shrink or fused or warm or group" \
  > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
modes=(as:act_shrink=true asp:act_shrink=true,act_shrink_expand_pdl=true g1:run_expand_group=1
  gp800:run_expand_group_programs=800 gp1200:run_expand_group_programs=1200
  asgp:act_shrink=true,run_expand_group_programs=800)
timeout $((470 - SECONDS)) python benchmarks/scripts/decode_knobs_ab.py --batch 72 128 --adapters 24 \
  --rounds 2 --mode "${modes[@]}" --out "$out/graphs_ab.json" > "$out/graphs_ab.txt" 2>&1
echo "graphs A/B rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((540 - SECONDS)) python benchmarks/scripts/decode_lora_anatomy.py --rounds 2 \
  --mode g1:run_expand_group=1 g4:run_expand_group=4 gp800:run_expand_group_programs=800 \
  --profile-mode default g1 g4 --point decode-runs:72:24 decode-runs:128:32 \
  --out "$out/anatomy_groups.json" > "$out/anatomy_groups.txt" 2>&1
echo "anatomy groups rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((585 - SECONDS)) python benchmarks/scripts/decode_lora_anatomy.py --rounds 2 \
  --cases mixed mixed-sorted prefill --out "$out/anatomy_mixed.json" > "$out/anatomy_mixed.txt" 2>&1
echo "anatomy mixed rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR)" "$out/tests.txt" | head -8
grep -iE "Error|Traceback" "$out/graphs_ab.txt" | head -5
grep -h "^B=" "$out/graphs_ab.txt" | cut -c1-600
grep -h -A9 "^==" "$out/anatomy_groups.txt" "$out/anatomy_mixed.txt" | cut -c1-300
