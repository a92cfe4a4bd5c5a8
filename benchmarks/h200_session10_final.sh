#!/usr/bin/env bash
# Session 10, call 3 (one H200), under 9 minutes, with direct Triton launches and SGMV launch plans:
#  1. GPU tests the earlier calls' 120 s cap cut: fused ops, attention, fused decode (every base kernel
#     now launches directly), then the Llama family against HF + PEFT.
#  2. Issue 23's rank mixes: benchmarks/h200_ranks.sh steps 1-2 (its tests, then {8}, {16}, {64}, {8,64}
#     in a rank-64 pool, two rounds of [base-only, each mix] in one process).
# Usage: bash benchmarks/h200_session10_final.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 100 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_fused_ops.py tests/kernels/test_attention.py \
  tests/kernels/test_fused_decode.py > "$out/kernel_tests.txt" 2>&1
echo "kernel tests rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
timeout 70 python -m pytest -q -p no:cacheprovider -x tests/models/test_llama_family_vs_peft.py > "$out/model_tests.txt" 2>&1
echo "model tests rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
timeout 70 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_rank_buckets.py \
  tests/kernels/test_lora_warmup.py tests/kernels/test_cuda_graph.py -k "rank or warm or on_by_default" \
  > "$out/rank_tests.txt" 2>&1
echo "rank tests rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
left=$((520 - SECONDS))
timeout "$left" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 \
  --hf-batch 0 --micro-batch --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 --sweep-rounds 2 \
  --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
tail -2 "$out/kernel_tests.txt" "$out/model_tests.txt" "$out/rank_tests.txt"
grep -E "ranks|base-only" "$out/mixes.log" | grep -v "^ " | tail -12
