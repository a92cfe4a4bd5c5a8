#!/usr/bin/env bash
# Session 13, call 1 (one H200), under 9.5 minutes, issue 13: the whole LoRA delta of small batches on the
# side stream (lora_side_max_tokens, default 256 in this commit).
#  1. GPU tests: the side delta (chain, eager and graph), PDL, the two-phase LoRA; then the CUDA model tests
#     against HF + PEFT (which now run the decode LoRA on the side stream). Stops if a kernel test fails.
#  2. benchmarks/scripts/lora_side_ab.py: decode graphs, delta / side (shrink only) / plain, B=32/64/128.
#  3. The issue-13 serving command with the decode microbenchmark, --sweep-rounds 2 (default: delta on).
#  4. The 32-adapter serving run with --lora-side-max-tokens 0 (the shrink-only split), two rounds.
# Usage: bash benchmarks/h200_session13.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 100 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_lora_side_delta.py \
  tests/kernels/test_lora_pdl.py tests/kernels/test_lora_kernels.py -k "side or pdl or start_lora" \
  > "$out/tests.txt" 2>&1
rc=$?
echo "kernel tests rc=$rc at ${SECONDS} s" | tee "$out/rc.txt"
if [ "$rc" -ne 0 ]; then tail -60 "$out/tests.txt"; exit 1; fi
timeout 120 python -m pytest -q -p no:cacheprovider tests/models > "$out/tests_models.txt" 2>&1
echo "model tests rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
tail -5 "$out/tests_models.txt"
timeout 140 python benchmarks/scripts/lora_side_ab.py --out "$out/side_ab.json" > "$out/side_ab.txt" 2>&1
echo "side a/b rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep -v Warning "$out/side_ab.txt" | tail -12
left=$((470 - SECONDS))
timeout "$left" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
  --num-requests 192 --hf-batch 0 --sweep-rounds 2 --micro-batch 32 128 --allow-compiles --out "$out/rounds" \
  > "$out/rounds.log" 2>&1
echo "rounds rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
python benchmarks/scripts/serving_summary.py "$out" rounds > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
left=$((570 - SECONDS))
timeout "$left" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 \
  --num-requests 192 --hf-batch 0 --sweep-rounds 2 --micro-batch --allow-compiles --lora-side-max-tokens 0 \
  --out "$out/split" > "$out/split.log" 2>&1
echo "split rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
python benchmarks/scripts/serving_summary.py "$out" split > "$out/summary_split.txt" 2>&1
cat "$out/summary_split.txt"
