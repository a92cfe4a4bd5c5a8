#!/usr/bin/env bash
# Written in session 35 after its device time was spent; ran in session 39 (benchmarks/results/h100-2026-12-06-session39/g/). One call, about
# 450 s, on an H200 if one comes:
# 1. upload_launch_probe.py: does a burst of adapter uploads (pinned host-to-device copies on a side stream)
#    hold the host in a step's small pageable input copies, and would pinned inputs not be held?
# 2. the CUDA test of the pinned step inputs (tests/unit/test_host_copy.py);
# 3. issue 13's serving command (default backend, 8 / 32 / 1000 adapters, decode micro-benchmark, two sweep
#    rounds) with the defaults (on an H200: the first run of sessions 34's and 35's defaults there), then with
#    the step inputs in page-locked memory (host-copy:pinned=true). It becomes a default only if the mixed
#    steps' launch time with uploads falls and no ratio falls in either round.
# 4. issue 23: the decode-run expand's rank step of 64 (run_expand_rank_step=64, which lets the column-tile
#    groups apply in a rank-64 bucket) in the LoRA kernels' anatomy, ranks {64} and {8, 64}, two rounds.
# Usage: bash benchmarks/h200_session35_g.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
timeout 90 python benchmarks/scripts/upload_launch_probe.py --out "$out/probe.json" > "$out/probe.txt" 2>&1
echo "probe rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
timeout 60 python -m pytest -q -rfE -p no:cacheprovider tests/unit/test_host_copy.py > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee -a "$out/summary.txt"
# Issue 23: in a rank-64 bucket the decode-run expand loops over the rank in steps of 32 and is never grouped,
# so a mix's rank-8 half loses gate_up's groups of 4 (session 35, e/). A step of 64 lets the rule group it;
# it was slower at rank 64 before the groups existed (session 15).
for spec in "r64:64" "mix:8 64"; do
  # shellcheck disable=SC2086
  timeout 60 python benchmarks/scripts/decode_lora_anatomy.py --point decode-runs:72:24:runs decode-runs:128:32:runs \
    --pool-rank 64 --page-rank 16 --rounds 2 --mode rs64:run_expand_rank_step=64 --profile-mode default rs64 \
    --rank ${spec#*:} --out "$out/anatomy_${spec%%:*}.json" > "$out/anatomy_${spec%%:*}.txt" 2>&1
  echo "anatomy ${spec%%:*} rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
done
knob=host-copy:pinned=true
source "$(dirname "$0")/serving_ab.sh"
cat "$out/probe.txt"
grep -h "^==" "$out"/anatomy_*.txt | cut -c1-200
python benchmarks/scripts/serving_summary.py "$out" serving knobs 2>&1 | head -60
python benchmarks/scripts/launch_by_uploads.py "$out/serving/serving.json" "$out/knobs/serving.json" 2>&1
true
