#!/usr/bin/env bash
# Session 17's last H200 call, under 9 minutes: lora_page_rank unset now pages a CUDA pool of rank 64 by 16
# (62cea95). 1. The CUDA tests that build engines with the default page rank or a rank-32/64 pool (graphs,
# warm-up, uploads beside the forwards, the model families against HF + PEFT on CUDA). 2. Issue 23's rank
# mixes in the default rank-64 pool, two rounds, compiles counted (c1 of this session: the same unpaged).
# Usage: bash benchmarks/h200_session17.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_cuda_graph.py \
  tests/kernels/test_lora_warmup.py tests/unit/test_slot_loads_beside.py tests/models/test_gemma2_vs_peft.py \
  tests/models/test_qwen2_vl_vs_peft.py tests/models/test_llama_family_vs_peft.py -k "cuda or graph or warm or triton" \
  > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
tail -3 "$out/tests.txt"
grep -E "^(FAILED|ERROR)" "$out/tests.txt" | head -20
timeout $((560 - SECONDS)) python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 \
  --num-requests 192 --hf-batch 0 --allow-compiles --rank-mixes 8 16 64 8,64 --pool-rank 64 --sweep-rounds 2 \
  --out "$out/mixes" > "$out/mixes.log" 2>&1
echo "mixes rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep -o "engine up[^;]*" "$out/mixes.log"
grep "mmlora \|base-only ranks\|compile" "$out/mixes.log" | sed 's/.*run\/s\]//'
