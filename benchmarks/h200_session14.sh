#!/usr/bin/env bash
# Session 14, call 1 (one H200), under 9 minutes, issue 13 item 3 (and issue 23 at rank 64):
#  1. GPU tests of the SGMV/auto kernels (the expand's one-load split-K planes) and the CUDA-graph runner.
#  2. benchmarks/scripts/decode_lora_anatomy.py at rank 16 and rank 64: add_lora per case (two rounds), the
#     planes loaded one by one against at once, segment entries B // 2 against the batch's runs, each
#     kernel's GPU time, and the bytes' floor at copy bandwidth.
# Usage: bash benchmarks/h200_session14.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 100 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_lora_kernels.py \
  tests/kernels/test_cuda_graph.py -k "sgmv or auto or graph" > "$out/tests.txt" 2>&1
echo "kernel tests rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
tail -3 "$out/tests.txt"
timeout 220 python benchmarks/scripts/decode_lora_anatomy.py --rank 16 --out "$out/anatomy_r16.json" \
  > "$out/anatomy_r16.txt" 2>&1
echo "anatomy r16 rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep -v Warn "$out/anatomy_r16.txt"
left=$((500 - SECONDS))
timeout "$left" python benchmarks/scripts/decode_lora_anatomy.py --rank 64 --out "$out/anatomy_r64.json" \
  > "$out/anatomy_r64.txt" 2>&1
echo "anatomy r64 rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep -v Warn "$out/anatomy_r64.txt" | grep "=="
