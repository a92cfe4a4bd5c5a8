#!/usr/bin/env bash
# Issue 13 / 23: decode graphs in the "runs" layout (SGMV over runs of rows on one adapter) against the
# per-row layout (BGMV) triton-auto captured before. One H200, bf16, dummy Mistral-7B, rank 16, one call.
#  1. GPU tests of the change (<= 180 s): runs-layout kernels with NaN rank padding, graphs in both
#     layouts against eager tokens, the check-memo and warm-up tests (the check-memo test was fixed
#     test-side in 569d03d and never rerun on a GPU).
#  2. Serving, twice, alternating (each run has its own base-only point):
#     runs$i: the default backend (triton-auto, both graph layouts), 8 / 32 / 1000 adapters;
#     rows$i: the same code with triton-auto's graphs limited to per-row BGMV (before), 32 adapters.
#     Both with the decode microbenchmark at B = 32 and 128.
# Usage: bash benchmarks/h200_graph_runs.sh OUTDIR      (about 8 minutes; read OUTDIR/summary.txt)
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout 180 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_rank_buckets.py \
  tests/kernels/test_lora_check_memo.py tests/kernels/test_lora_warmup.py tests/models/test_smollm2.py \
  tests/kernels/test_cuda_graph.py -k "not triton_attention_matches and not dummy_preset" \
  > "$out/tests.txt" 2>&1
echo "pytest rc=$?" | tee "$out/rc.txt"
common=(--model dummy:mistral-7b-v0.3 --num-requests 192 --hf-batch 0 --micro-batch 32 128 --allow-compiles)
for i in 1 2; do
  timeout 125 python -m mmlora.bench serving "${common[@]}" --num-adapters 8 32 1000 --out "$out/runs$i" \
    > "$out/runs$i.log" 2>&1
  echo "runs$i rc=$?" | tee -a "$out/rc.txt"
  timeout 85 python benchmarks/scripts/rows_only_graphs.py serving "${common[@]}" --num-adapters 32 \
    --out "$out/rows$i" > "$out/rows$i.log" 2>&1
  echo "rows$i rc=$?" | tee -a "$out/rc.txt"
done
python benchmarks/scripts/serving_summary.py "$out" runs1 rows1 runs2 rows2 > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
