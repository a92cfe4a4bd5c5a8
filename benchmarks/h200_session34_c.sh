#!/usr/bin/env bash
# Session 34, third call (about 580 s), with run_expand_group_programs=1000 the default.
# On an H200: 1. issue 13's serving command (default backend, 8 / 32 / 1000 adapters, decode micro-benchmark,
# two sweep rounds); 2. the four SGMV decode-run opt-ins never timed on an H200 (shrink_pdl,
# run_expand_h_unroll=16, run_expand_group_b_first, run_shrink_k_per_split=1024) in real decode graphs (B=72
# and 128 on 24 adapters, two rounds); 3. issue 23's rank-8 and rank-16 mixes (32 adapters, rank-64 pool
# paged by 16, two rounds), whose rank bucket of 16 the group rule touches.
# On an H100 (the H200 targets cannot be judged there): issue 23's rank-8 and rank-16 mixes with the rule and
# without it (run_expand_group_programs=null), two rounds each.
# Usage: bash benchmarks/h200_session34_c.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
mixes=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --rank-mixes 8 16
  --pool-rank 64 --sweep-rounds 2)
if grep -q H200 "$out/gpu.txt"; then
  args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 --num-requests 192 --hf-batch 0
    --micro-batch 32 128 --sweep-rounds 2)
  echo "python -m mmlora.bench ${args[*]}" > "$out/command.txt"
  timeout 260 python -m mmlora.bench "${args[@]}" --out "$out/serving" > "$out/serving.log" 2>&1
  echo "serving rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
  modes=(spdl:shrink_pdl=true hu16:run_expand_h_unroll=16 bf:run_expand_group_b_first=true
    k1024:run_shrink_k_per_split=1024)
  timeout $((420 - SECONDS)) python benchmarks/scripts/decode_knobs_ab.py --batch 72 128 --adapters 24 \
    --rounds 2 --mode "${modes[@]}" --out "$out/graphs_ab.json" > "$out/graphs_ab.txt" 2>&1
  echo "graphs A/B rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
  echo "python -m mmlora.bench ${mixes[*]}" >> "$out/command.txt"
  timeout $((590 - SECONDS)) python -m mmlora.bench "${mixes[@]}" --out "$out/mixes" > "$out/mixes.log" 2>&1
  echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
  python benchmarks/scripts/serving_summary.py "$out" serving 2>&1 | head -30
  grep -o "B=[0-9]* round.\{0,420\}" "$out/graphs_ab.txt"
  grep -h "^B=[0-9]*:" "$out/graphs_ab.txt" | cut -c1-300
else
  echo "python -m mmlora.bench ${mixes[*]}" > "$out/command.txt"
  echo "python benchmarks/scripts/with_tuning.py triton-sgmv:run_expand_group_programs=null -- ${mixes[*]}" \
    >> "$out/command.txt"
  timeout 290 python -m mmlora.bench "${mixes[@]}" --out "$out/mixes" > "$out/mixes.log" 2>&1
  echo "mixes rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
  timeout $((590 - SECONDS)) python benchmarks/scripts/with_tuning.py triton-sgmv:run_expand_group_programs=null \
    -- "${mixes[@]}" --out "$out/mixes_g2" > "$out/mixes_g2.log" 2>&1
  echo "mixes without the rule rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
fi
grep -ihE "Error|Traceback" "$out"/*.log | head -6
python benchmarks/scripts/serving_summary.py "$out" mixes 2>&1 | head -30
[ -d "$out/mixes_g2" ] && python benchmarks/scripts/serving_summary.py "$out" mixes_g2 2>&1 | head -30
true
