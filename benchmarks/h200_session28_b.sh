#!/usr/bin/env bash
# For the next session with a GPU (written in session 28, which was lent none; not yet run). SGMV's decode-run
# expand sums the shrink's split-K planes of h (about 8 at serving's B=72 on 24 adapters) in a loop that
# waits for each plane before it loads the next; TUNING["run_expand_h_unroll"] (opt-in) issues those loads
# unrolled, all in flight together, as the fused activation has since session 22; and a grouped expand
# program (the default for rank-16 decode runs) loads its first tile's B only after h, where an ungrouped one
# loads it before the PDL wait; TUNING["run_expand_group_b_first"] (opt-in) loads it before the wait and its
# out tile right after. Here: their GPU kernel tests
# (the reference and the looped sum's bits, 8 planes as serving makes them), then the LoRA kernels at
# serving's decode composition with it as modes, alone and with the split-K waves that decide the plane
# count (run_waves 1: about 4 planes; 4: about 15) and with the out tile loaded early (whose gain, none in
# session 27, a serial sum of h may have hidden), two rounds, rank 16, then rank 64 paged by 16. Make it
# the default only where it is faster in both rounds at every point; then run issue 13's command with it
# through with_tuning.py (triton-sgmv:run_expand_h_unroll=16 and / or
# triton-sgmv:run_expand_group_b_first=true), after the PDL tests of h200_session28_a.sh (which cover them).
# Session 29 (also lent no GPU) added run_shrink_k_per_split (decode-run shrinks split in_features into parts
# of at most this many: down's 14,336 otherwise give each program 3.5x the others' serial loop; its shrink
# took 9.3 us against 4.4-6.2) as modes k1024, hu16bfk512, hu16bfk1024, and per-kernel times of three modes.
# Usage: bash benchmarks/h200_session28_b.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
date -u > "$out/date.txt"
timeout 120 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_sgmv_run_knobs.py -k "h_unroll or run_expand_groups or k_per_split" \
  > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
modes=(hu16:run_expand_h_unroll=16 bf:run_expand_group_b_first=true
  hu16bf:run_expand_h_unroll=16,run_expand_group_b_first=true w1:run_waves=1
  hu16bfw1:run_expand_h_unroll=16,run_expand_group_b_first=true,run_waves=1
  hu16bfw4:run_expand_h_unroll=16,run_expand_group_b_first=true,run_waves=4
  hu16g1:run_expand_h_unroll=16,run_expand_group=1
  hu16e:run_expand_h_unroll=16,run_expand_early_out=true
  k1024:run_shrink_k_per_split=1024
  hu16bfk512:run_expand_h_unroll=16,run_expand_group_b_first=true,run_shrink_k_per_split=512
  hu16bfk1024:run_expand_h_unroll=16,run_expand_group_b_first=true,run_shrink_k_per_split=1024)
timeout $((400 - SECONDS)) python benchmarks/scripts/decode_lora_anatomy.py --rounds 2 --mode "${modes[@]}" \
  --profile-mode default hu16bf hu16bfk1024 hu16g1 \
  --point decode-runs:72:24 decode-runs:72:24:runs decode-runs:72:6:runs decode-runs:128:32:runs \
  --out "$out/anatomy_r16.json" > "$out/anatomy_r16.txt" 2>&1
echo "rank 16 rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((560 - SECONDS)) python benchmarks/scripts/decode_lora_anatomy.py --rounds 2 --mode "${modes[@]}" \
  --profile-mode default hu16bf hu16bfk1024 hu16g1 --rank 64 --page-rank 16 --point decode-runs:72:24:runs \
  --out "$out/anatomy_r64.json" > "$out/anatomy_r64.txt" 2>&1
echo "rank 64 rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR)" "$out/tests.txt" | head -8
grep -h "^==" "$out/anatomy_r16.txt" "$out/anatomy_r64.txt" | cut -c1-400
