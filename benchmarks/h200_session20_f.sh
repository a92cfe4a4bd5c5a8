#!/usr/bin/env bash
# Session 20, call 6: the pool's upload path on CUDA after the lazy slot views (5aa9572) and the moves of
# slot_pairs / copy_scalings (fb02134): the pool and slot-load tests (their CUDA cases: pinned staging,
# loads on the upload stream) and the paged-pool kernel tests.
# Usage: bash benchmarks/h200_session20_f.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 170 python -m pytest -q -rfE -p no:cacheprovider tests/unit/test_pool.py tests/unit/test_slot_loads_beside.py \
  tests/unit/test_page_map.py tests/kernels/test_lora_paged.py > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
tail -3 "$out/tests.txt"
