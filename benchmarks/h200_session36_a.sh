#!/usr/bin/env bash
# Session 36, one call (about 560 s), on an H200 if one comes:
# 1. shrink_in_gemm_probe.py: cuBLAS's decode GEMMs with E more output rows (every staged slot's rank rows,
#    the shrink riding on the base GEMM as the CPU path's [W; A] does), against E=0: is that cheaper than the
#    decode shrinks' 22 us a layer?
# 2. decode_lora_anatomy.py at serving's pool (rank 16, unpaged) and decode runs: the shrinks' own us, rank 16;
# 3. session 35's next call, h200_session35_g.sh (upload probe, pinned inputs' test, run_expand_rank_step=64's
#    anatomy, issue 13's serving with the defaults and with host-copy:pinned=true).
# Usage: bash benchmarks/h200_session36_a.sh OUTDIR
source "$(dirname "$0")/device_preamble.sh" "$@"
timeout 90 python benchmarks/scripts/shrink_in_gemm_probe.py --out "$out/gemm_probe.json" > "$out/gemm_probe.txt" 2>&1
echo "gemm probe rc=$? at ${SECONDS} s" | tee "$out/summary36.txt"
timeout 60 python benchmarks/scripts/decode_lora_anatomy.py --point decode-runs:72:24:runs decode-runs:128:32:runs \
  --rounds 2 --rank 16 --out "$out/anatomy_r16.json" > "$out/anatomy_r16.txt" 2>&1
echo "anatomy r16 rc=$? at ${SECONDS} s" | tee -a "$out/summary36.txt"
source "$(dirname "$0")/h200_session35_g.sh" "$out"
cat "$out/summary36.txt" "$out/gemm_probe.txt"
grep -h "^==\|^   " "$out/anatomy_r16.txt" | cut -c1-160
true
