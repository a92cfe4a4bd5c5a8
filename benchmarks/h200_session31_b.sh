#!/usr/bin/env bash
# Session 31's second call, made on the machine that ran its first (h200_session31_a.sh, which left its
# decode knobs' graphs A/B in artifacts/s31/graphs_ab.json). The winning decode knobs
# (pick_knob_winners.py: faster in every round at every batch, with the defaults' tokens) go through
# their GPU tests and issue 13's serving command at 32 adapters, defaults against the knobs, two rounds
# (h200_session28_c.sh). Where no mode won, or the A/B is missing, issue 13's full
# command runs on the defaults instead, for fresh figures.
# Usage: bash benchmarks/h200_session31_b.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
ab=artifacts/s31/graphs_ab.json
knobs=""
if [ -f "$ab" ]; then
  knobs=$(python benchmarks/scripts/pick_knob_winners.py "$ab" 2> "$out/picked.txt")
  cat "$out/picked.txt"
fi
if [ -n "$knobs" ]; then
  echo "knobs: $knobs"
  # shellcheck disable=SC2086  # one word per knob
  bash benchmarks/h200_session28_c.sh "$out/c2" $knobs
else
  echo "no winning knobs: issue 13's full command on the defaults"
  date -u > "$out/date.txt"
  timeout 580 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
    --num-requests 192 --hf-batch 0 --micro-batch 32 128 --sweep-rounds 2 --out "$out/serving" \
    > "$out/serving.log" 2>&1
  echo "serving rc=$?"
  grep -h "mmlora \|base-only" "$out/serving.log" | sed 's/.*run\/s\]//' | cut -c1-200
fi
