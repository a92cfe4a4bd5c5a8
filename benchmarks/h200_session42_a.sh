#!/usr/bin/env bash
# Session 42, one call of about 430 s: lora_stage_slots auto (the new default: 32 positions where they take at
# most 5% of the KV cache's memory). 1. benchmarks/scripts/stage_memory.py beside issue 23's pool (128 rank-64
# slots paged by 16): the stage off, then auto (memory_r64.json: what auto chose there; issue 13's runs
# record theirs in serving.json's "memory"); 2. issue 13's command (two sweep rounds)
# with the defaults (auto; serving/) against the stage off (--lora-stage-slots 0; off/).
# Usage: bash benchmarks/h200_session42_a.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
rm -f "$out/commit.txt"  # stale; the call returns at most eight files
for rank in 64; do
  echo "python benchmarks/scripts/stage_memory.py OUT/memory_r$rank.json --slots 128 --rank $rank --arms new:0 new:auto" \
    >> "$out/command.txt"
  timeout 70 python benchmarks/scripts/stage_memory.py "$out/memory_r$rank.json" --slots 128 --rank $rank \
    --arms new:0 new:auto > "$out/memory_r$rank.log" 2>&1
  echo "stage_memory rank $rank rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
  grep '^{' "$out/memory_r$rank.log"
done
# NUM_ADAPTERS: fewer adapter counts where device time is short (default: issue 13's 8 32 1000).
read -ra counts <<< "${NUM_ADAPTERS:-8 32 1000}"
args=(serving --model dummy:mistral-7b-v0.3 --num-adapters "${counts[@]}" --num-requests 192 --hf-batch 0
  --micro-batch 32 128 --sweep-rounds 2)
echo "python -m mmlora.bench ${args[*]}" >> "$out/command.txt"
echo "python -m mmlora.bench ${args[*]} --lora-stage-slots 0" >> "$out/command.txt"
timeout $(((590 - SECONDS) / 2)) python -m mmlora.bench "${args[@]}" --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving (auto) rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((590 - SECONDS)) python -m mmlora.bench "${args[@]}" --lora-stage-slots 0 --out "$out/off" \
  > "$out/off.log" 2>&1
echo "serving (stage off) rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
# What is left of the call: the stage's engine tests and the decode graph tests on CUDA, now that the stage
# is on by default there (stopped with SIGINT so that a run cut off still prints what ran).
if ((SECONDS < 520)); then
  echo "python -m pytest -q -rfE tests/kernels/test_lora_stage_engine.py tests/kernels/test_cuda_graph.py" >> "$out/command.txt"
  timeout -s INT -k 5 $((590 - SECONDS)) python -m pytest -q -rfE -p no:cacheprovider \
    tests/kernels/test_lora_stage_engine.py tests/kernels/test_cuda_graph.py > "$out/tests_stage_graphs.txt" 2>&1
  echo "stage + graph tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests_stage_graphs.txt")" | tee -a "$out/summary.txt"
fi
grep -ihE "Error|Traceback" "$out"/*.log | head -8
python benchmarks/scripts/serving_summary.py "$out" serving off 2>&1 | head -60
true
