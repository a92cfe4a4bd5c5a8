#!/usr/bin/env bash
# Session 35 (about 450 s): issue 23, where a rank mix's LoRA time goes.
# 1. decode_lora_anatomy.py at serving's decode runs (B=72 on 24 adapters, B=128 on 32; rank-64 pool paged by
#    16, two rounds): ranks {8}, {64}, {8, 64} with rows by slot (what the engine does), and {8, 64} with rows
#    heavy-first (rank-64 runs first in the grid, so their longer programs do not make the launch's tail).
#    Says per kernel whether the mix costs about the mean of its parts or about its rank-64 part.
# 2. Issue 23's {64} and {8, 64} serving runs (32 adapters, two sweep rounds) with the current defaults.
# Usage: bash benchmarks/h200_session35_e.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
cat "$out/gpu.txt"
points=(--point decode-runs:72:24:runs decode-runs:128:32:runs --pool-rank 64 --page-rank 16 --rounds 2)
for spec in "r8:8" "r64:64" "mix:8 64" "mixhf:8 64 --heavy-first"; do
  name=${spec%%:*}
  # shellcheck disable=SC2086
  timeout 90 python benchmarks/scripts/decode_lora_anatomy.py "${points[@]}" --rank ${spec#*:} \
    --out "$out/anatomy_$name.json" > "$out/anatomy_$name.txt" 2>&1
  echo "anatomy $name rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
done
mixes=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --rank-mixes 64 8,64
  --pool-rank 64 --sweep-rounds 2)
echo "python -m mmlora.bench ${mixes[*]}" > "$out/command.txt"
timeout $((590 - SECONDS)) python -m mmlora.bench "${mixes[@]}" --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -ihE "Error|Traceback" "$out"/*.txt "$out"/*.log | head -6
for name in r8 r64 mix mixhf; do
  echo "--- $name"
  grep -h "^==\|^   " "$out/anatomy_$name.txt" | cut -c1-160
done
python benchmarks/scripts/serving_summary.py "$out" mixes 2>&1 | head -40
true
