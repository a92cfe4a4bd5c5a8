#!/usr/bin/env bash
# Session 20, call 5 (the call-4 command at 1000 adapters only, after the lazy slot views): where Scheduler.schedule's host time goes at 32 and 1000 adapters (one round, cProfile
# over every schedule call): benchmarks/scripts/schedule_profile.py around issue 13's serving command.
# Usage: bash benchmarks/h200_session20_d.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for n in 1000; do
  timeout 200 python benchmarks/scripts/schedule_profile.py --top 40 -- --model dummy:mistral-7b-v0.3 \
    --num-adapters "$n" --num-requests 192 --hf-batch 0 --micro-batch --sweep-rounds 1 --out "$out/serving_$n" \
    > "$out/schedule_profile_$n.txt" 2>&1
  echo "$n rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
  grep -A30 "== schedule, by cumulative" "$out/schedule_profile_$n.txt" | head -34
done
