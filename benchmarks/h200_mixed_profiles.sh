#!/usr/bin/env bash
# An eager mixed step's host time (benchmarks/scripts/mixed_step_profile.py): 128 decode rows plus one
# 512-token prompt a step, with 32 rank-16 adapters and base-only; each writes OUT/mixed_a{32,0}.txt
# (step wall, GPU span, forward host time, cProfile and torch.profiler tables) and a line to OUT/rc.txt.
# Usage: bash benchmarks/h200_mixed_profiles.sh OUTDIR (from the repository root, PYTHONPATH set)
set -u
out=${1:?output folder}
for a in 32 0; do
  timeout 75 python benchmarks/scripts/mixed_step_profile.py --adapters $a --chunk 512 --steps 8 \
    > "$out/mixed_a$a.txt" 2>&1
  echo "profile a=$a rc=$? after ${SECONDS} s of profiles" | tee -a "$out/rc.txt"
  grep "step wall" "$out/mixed_a$a.txt"
done
