#!/usr/bin/env bash
# Session 34, second call (about 560 s): SGMV's decode-run expand groups chosen per launch by program count
# (run_expand_group_programs=1000: gate_up in groups of 4, qkv of 2 or 1, o and down of 1 at serving's
# batches; the best group of each kernel in c1's per-kernel anatomy at B=72 and 128), against the defaults:
# 1. its GPU tests; 2. real decode graphs (decode_knobs_ab.py: B=72 and 128 on 24 adapters, two rounds, with
# one group for all, run_expand_group=1, beside it); 3. issue 13's serving command (default backend,
# 8 / 32 / 1000 adapters, decode micro-benchmark, two sweep rounds) with the defaults, then with the rule, on
# one warm card in one call.
# Usage: bash benchmarks/h200_session34_b.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
timeout 60 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_sgmv_run_knobs.py \
  -k "by_programs or k_per_split or run_expand_groups" > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
knob=run_expand_group_programs=1000
timeout 100 python benchmarks/scripts/decode_knobs_ab.py --batch 72 128 --adapters 24 --rounds 2 \
  --mode "gp1000:$knob" g1:run_expand_group=1 --out "$out/graphs_ab.json" > "$out/graphs_ab.txt" 2>&1
echo "graphs A/B rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
source "$(dirname "$0")/serving_ab.sh"
source "$(dirname "$0")/ab_report.sh"
