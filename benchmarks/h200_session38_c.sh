#!/usr/bin/env bash
# For the next session (written in session 38 after its device time was spent; not yet run). One call, about
# 585 s. Session 38 (H100, b/) found the stage (--lora-stage-slots 32, placed within the narrowest staged
# graph) ahead at 8 and 32 adapters and 0.002 behind at 1000 in both rounds. A staged GEMM reads every
# position of its layout, so a batch that fills little more than half of it reads up to twice its adapters'
# A; stage:min_fill sends such batches to the usual kernels. This asks:
# 1. the decode micro-benchmark at B = 8, 16 and 32 on 32 adapters with the stage: each batch replayed in
#    every layout it fits (rows, runs, staged/4, staged/2, staged), so a batch's staged graphs at several
#    fills are timed against BGMV's rows on the same rows and adapters;
# 2. issue 13's command (two rounds), the defaults against the stage with min_fill 0.75, the candidate
#    default: it becomes one only if no ratio falls in either round.
# Usage: bash benchmarks/h200_session38_c.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
micro=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 32 --hf-batch 0
  --micro-batch 8 16 32 --lora-stage-slots 32)
args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 --num-requests 192 --hf-batch 0
  --micro-batch 32 128 --sweep-rounds 2)
{
  echo "python -m mmlora.bench ${micro[*]}"
  echo "python -m mmlora.bench ${args[*]}"
  echo "python benchmarks/scripts/with_tuning.py stage:min_fill=0.75 -- ${args[*]} --lora-stage-slots 32"
} > "$out/command.txt"
timeout 170 python -m mmlora.bench "${micro[@]}" --out "$out/micro" > "$out/micro.log" 2>&1
echo "micro rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
timeout $(((585 - SECONDS) / 2)) python -m mmlora.bench "${args[@]}" --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((585 - SECONDS)) python benchmarks/scripts/with_tuning.py stage:min_fill=0.75 -- "${args[@]}" \
  --lora-stage-slots 32 --out "$out/staged_fill" > "$out/staged_fill.log" 2>&1
echo "serving staged, min_fill 0.75 rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -ihE "Error|Traceback" "$out"/*.txt "$out"/*.log | head -8
grep -h "engine up\|decode step B=" "$out"/*.log | cut -c1-400
python benchmarks/scripts/serving_summary.py "$out" serving staged_fill 2>&1 | head -70
true
