#!/usr/bin/env bash
# Session 20, call 1: the GPU tests of the SGMV expand's shared h reader (_h_tile, 537dded: until now
# interpreter-tested only) and of everything that launches it with the grouped expand on by default: the
# LoRA kernels, paged pools, rank buckets, CUDA graphs and the warm-up (no compile after it), in three
# pytest processes side by side (their Triton compiles are CPU work).
# Usage: bash benchmarks/h200_session20_a.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
t() { timeout 330 python -m pytest -q -rfE -p no:cacheprovider "$@"; }
t tests/kernels/test_lora_kernels.py > "$out/tests_kernels.txt" 2>&1 &
t tests/kernels/test_lora_paged.py tests/kernels/test_rank_buckets.py > "$out/tests_paged.txt" 2>&1 &
t tests/kernels/test_cuda_graph.py tests/kernels/test_lora_warmup.py > "$out/tests_graphs.txt" 2>&1 &
wait
for f in "$out"/tests_*.txt; do echo "$(basename "$f"): $(tail -1 "$f")"; done | tee "$out/summary.txt"
