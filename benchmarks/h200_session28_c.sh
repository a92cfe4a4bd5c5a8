#!/usr/bin/env bash
# For the next session with a GPU (written in session 28, which was lent none; not yet run). The fast path to
# the one figure that decides: issue 13's 32-adapter ratio with the three untimed decode-latency opt-ins on
# together (SGMV's shrink as the base GEMM's dependent launch, shrink_pdl; h's planes summed unrolled,
# run_expand_h_unroll; a grouped expand's first B tile before the PDL wait, run_expand_group_b_first),
# against the defaults, in one call: their GPU tests first (the PDL chains' bits and the float64
# reference with the knobs on, no partials read early), then issue 13's serving command at 32 adapters,
# two rounds, once with the defaults and once with the knobs (each run against its own base-only; each
# run's JSON counts any Triton compile in its timed runs). A default changes only if the knobs win both
# rounds with no compile; h200_session28_a.sh / _b.sh then tell the knobs apart.
# Usage: bash benchmarks/h200_session28_c.sh OUTDIR [BACKEND:KNOB=JSON ...] (the knobs to time; by default the three)
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
date -u > "$out/date.txt"
knobs=("${@:2}")  # BACKEND:KNOB=JSON overrides after OUTDIR (session 29); none given: session 28's three
if [ ${#knobs[@]} -eq 0 ]; then
  knobs=(triton-sgmv:shrink_pdl=true triton-sgmv:run_expand_h_unroll=16 triton-sgmv:run_expand_group_b_first=true)
fi
printf '%s\n' "${knobs[@]}" > "$out/knobs.txt"
if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1 where h200_session29_a.sh ran them on this commit
  timeout 170 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_pdl.py \
    tests/kernels/test_lora_kernels.py tests/kernels/test_sgmv_run_knobs.py -k "pdl or h_unroll or run_expand_groups or k_per_split" > "$out/tests.txt" 2>&1
  echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$out/tests.txt")" | tee "$out/summary.txt"
else
  echo "tests skipped" > "$out/tests.txt"
fi
serving=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --sweep-rounds 2)
timeout $((370 - SECONDS)) python -m mmlora.bench "${serving[@]}" --out "$out/default" > "$out/default.log" 2>&1
echo "defaults rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((575 - SECONDS)) python benchmarks/scripts/with_tuning.py "${knobs[@]}" -- "${serving[@]}" \
  --out "$out/knobs" > "$out/knobs.log" 2>&1
echo "knobs rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR)" "$out/tests.txt" | head -8
grep -iE "Error|Traceback" "$out/default.log" "$out/knobs.log" | head -5
grep -h "mmlora \|base-only" "$out/default.log" "$out/knobs.log" | sed 's/.*run\/s\]//' | cut -c1-200
