#!/usr/bin/env bash
# Session 37, call 3, not run (the session's device time ran out in machine refusals); for the next
# session. BUDGET seconds, default 440: the stage's CUDA tests after the paged expand's fix (reads
# only in a slot's own pages), issue 23's {8, 64} mix with the paged stage and a segment entry per row in
# the staged graphs (triton-auto:staged_segments="rows"; call b's 169 of 602 steps could not take the
# stage), two rounds; then, with what is left, issue 13's 1000 adapters alone, the defaults against the
# stage with a segment per row (call a: 0.709 / 0.702 against 0.704 / 0.693).
# Usage: BUDGET=440 bash benchmarks/h200_session37_c.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
budget=${BUDGET:-440}
timeout 110 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_stage.py > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
mix=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --pool-rank 64
  --sweep-rounds 2 --rank-mixes 8,64 --lora-stage-slots 80)
big=(serving --model dummy:mistral-7b-v0.3 --num-adapters 1000 --num-requests 192 --hf-batch 0 --sweep-rounds 2)
rows='triton-auto:staged_segments="rows"'
{
  echo "python benchmarks/scripts/with_tuning.py '$rows' -- ${mix[*]}"
  echo "python -m mmlora.bench ${big[*]}"
  echo "python benchmarks/scripts/with_tuning.py '$rows' -- ${big[*]} --lora-stage-slots 32"
} > "$out/command.txt"
timeout 150 python benchmarks/scripts/with_tuning.py "$rows" -- "${mix[@]}" --out "$out/mix_rows" > "$out/mix_rows.log" 2>&1
echo "mix staged rows rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
if ((budget - SECONDS < 200)); then echo "no time left for the 1000-adapter A/B" | tee -a "$out/summary.txt"; else
timeout $(((budget - 5 - SECONDS) / 2)) python -m mmlora.bench "${big[@]}" --out "$out/big" > "$out/big.log" 2>&1
echo "1000 defaults rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((budget - 5 - SECONDS)) python benchmarks/scripts/with_tuning.py "$rows" -- "${big[@]}" --lora-stage-slots 32 \
  --out "$out/big_rows" > "$out/big_rows.log" 2>&1
echo "1000 staged rows rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
fi
grep -ihE "Error|Traceback" "$out"/*.txt "$out"/*.log | head -8
python benchmarks/scripts/serving_summary.py "$out" mix_rows big big_rows 2>&1 | head -40
true
