#!/usr/bin/env bash
# Session 37, call 3, not run (the session's device time ran out in machine refusals); for the next
# session, about 270 s: the stage's CUDA tests after the paged expand's fix (reads only in a slot's own pages)
# and the staged layouts over a prefix of the positions (staged/2, staged/4); then issue 23's {8, 64} mix with
# the paged stage (80 positions) and a segment entry per row (now the default; call b's 169 of 602 steps
# could not take the stage with "half"), two rounds. Rerun benchmarks/h200_session37_a.sh after it: issue 13's
# command, defaults against the stage, now with the narrower staged layouts (call a read all 32 positions in
# every step, 8 adapters among them).
# Usage: bash benchmarks/h200_session37_c.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
timeout 110 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_stage.py > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
mix=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --pool-rank 64
  --sweep-rounds 2 --rank-mixes 8,64)
echo "python -m mmlora.bench ${mix[*]} --lora-stage-slots 80" > "$out/command.txt"
timeout 160 python -m mmlora.bench "${mix[@]}" --lora-stage-slots 80 --out "$out/mix_rows" > "$out/mix_rows.log" 2>&1
echo "mix staged rows rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -ihE "Error|Traceback" "$out"/*.txt "$out"/*.log | head -8
python benchmarks/scripts/serving_summary.py "$out" mix_rows 2>&1 | head -20
true
