#!/usr/bin/env bash
# For the next session with an H200 (written in session 34 after its device time was spent; not yet run).
# One call, about 560 s:
# 1. GPU tests of expand_dependents (the fused ops after a decode-run expand as its programmatic dependents)
#    and of the warm-up's expand groups (nothing compiles for wide decode runs after it).
# 2. Real decode graphs (decode_knobs_ab.py: B=72 and 128 on 24 adapters, two rounds): expand_dependents
#    against the defaults, tokens and logprobs compared.
# 3. Issue 13's serving command (default backend, 8 / 32 / 1000 adapters, decode micro-benchmark, two sweep
#    rounds) with the defaults (run_expand_group_programs=1000 since session 34, never run on an H200),
#    then with expand_dependents.
# expand_dependents becomes a default only if it is faster in both graph rounds at both batches with the
# same bits, and the serving run does not say otherwise.
# Usage: bash benchmarks/h200_session34_d.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
timeout 90 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_pdl.py \
  tests/kernels/test_lora_warmup.py -k "dependents or pdl_chain or wide or no_compile" > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
knob=expand_dependents=true
timeout 100 python benchmarks/scripts/decode_knobs_ab.py --batch 72 128 --adapters 24 --rounds 2 \
  --mode "xd:$knob" --out "$out/graphs_ab.json" > "$out/graphs_ab.txt" 2>&1
echo "graphs A/B rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
source "$(dirname "$0")/serving_ab.sh"
source "$(dirname "$0")/ab_report.sh"
