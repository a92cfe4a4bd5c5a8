#!/usr/bin/env bash
# For the next session with a GPU (written in session 26, not yet run). Session 26 found that most of the
# remaining LoRA cost of a decode step is fixed: 8 adapters (5-7.5 distinct a step, +0.1 ms of adapter bytes)
# cost +1.4 ms a step, 32 adapters (23 distinct, +0.46 ms) +1.65 ms, at serving's mean batch of 73 rows.
# Here: the LoRA kernels at that composition (decode runs, rank 16; with the segment entries a decode graph
# captures, B // 2, and with exactly the batch's runs) per projection and kernel, with the
# SGMV run knobs that were never timed on a GPU (TUNING notes say so) as modes, two rounds each, then the
# same for rank-64 adapters in the default paged pool. Pick a knob only where it is faster in both rounds
# at every point; then run issue 13's serving command with it through with_tuning.py.
# Usage: bash benchmarks/h200_session27_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
modes=(k64:run_shrink_block_k=64 k256:run_shrink_block_k=256 w4:run_waves=4 w8:run_waves=8
  st4:run_shrink_stages=4 early:run_expand_early_out=true g4:run_expand_group=4 ew4:run_expand_warps=4)
timeout 300 python benchmarks/scripts/decode_lora_anatomy.py --rounds 2 --mode "${modes[@]}" \
  --point decode-runs:72:24 decode-runs:72:24:runs decode-runs:72:6:runs decode-runs:128:32:runs \
  --out "$out/anatomy_r16.json" > "$out/anatomy_r16.txt" 2>&1
echo "rank 16 rc=$? at ${SECONDS} s" | tee "$out/summary.txt"
timeout $((540 - SECONDS)) python benchmarks/scripts/decode_lora_anatomy.py --rounds 2 --mode "${modes[@]}" \
  --rank 64 --page-rank 16 --point decode-runs:72:24:runs \
  --out "$out/anatomy_r64.json" > "$out/anatomy_r64.txt" 2>&1
echo "rank 64 rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep "^==" "$out/anatomy_r16.txt" "$out/anatomy_r64.txt" | cut -c1-400
