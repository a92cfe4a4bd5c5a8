#!/usr/bin/env bash
# Written in session 38 after its device time was spent; ran in session 39 (benchmarks/results/h100-2026-12-06-session39/c/). One call, about
# 590 s. Session 38 (H100, b/) found the stage (--lora-stage-slots 32, placed within the narrowest staged
# graph) ahead at 8 and 32 adapters and 0.002 behind at 1000 in both rounds. A staged GEMM reads every
# position of its layout, so a batch that fills little more than half of it reads up to twice its adapters'
# A; stage:min_fill sends such batches to the usual kernels. This asks:
# 1. the decode micro-benchmark at B = 8, 16 and 32 on 32 adapters with the stage: each batch replayed in
#    every layout it fits (rows, runs, staged/4, staged/2, staged), so a batch's staged graphs at several
#    fills are timed against BGMV's rows on the same rows and adapters (micro/);
# 2. issue 13's command (two rounds), the defaults (serving/) against the stage with min_fill 0.75 (knobs/),
#    the candidate default: it becomes one only if no ratio falls in either round.
# Usage: bash benchmarks/h200_session38_c.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
micro=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 32 --hf-batch 0
  --micro-batch 8 16 32 --lora-stage-slots 32)
echo "python -m mmlora.bench ${micro[*]}" > "$out/command.txt"
timeout 170 python -m mmlora.bench "${micro[@]}" --out "$out/micro" > "$out/micro.log" 2>&1
echo "micro rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
knob=stage:min_fill=0.75
extra=(--lora-stage-slots 32)
source "$(dirname "$0")/serving_ab.sh"
grep -ihE "Error|Traceback" "$out"/*.txt "$out"/*.log | head -8
grep -h "engine up\|decode step B=" "$out"/*.log | cut -c1-400
python benchmarks/scripts/serving_summary.py "$out" serving knobs 2>&1 | head -70
true
