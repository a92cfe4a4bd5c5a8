#!/usr/bin/env bash
# Session 19, call 3: SGMV's grouped expand for decode runs (``run_expand_group``, off by default).
#  1. Its GPU tests (and the run knobs' tests with shared-memory-sized parameters).
#  2. The decode-runs LoRA anatomy (rank-16 adapters, default rank-64 pool paged by 16) with groups of 2-16
#     column tiles, loop depth 1-3, and 4 warps, two rounds; kernels profiled for g4.
#  3. Issue 13's serving workload at 32 adapters, two rounds, default against the anatomy's best group mode
#     (picked by the summed time over the cases, printed), each with its own base-only runs.
# Usage: bash benchmarks/h200_session19_c.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 150 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_lora_kernels.py \
  tests/kernels/test_lora_paged.py -k "run_expand_groups or run_knobs or expand_groups" > "$out/tests.txt" 2>&1
echo "tests rc=$? at ${SECONDS} s" | tee "$out/rc.txt"
tail -2 "$out/tests.txt"
timeout 240 python benchmarks/scripts/decode_lora_anatomy.py --cases decode-runs --rank 16 --pool-rank 64 \
  --page-rank 16 --profile-mode g4 --mode g2:run_expand_group=2 g4:run_expand_group=4 g8:run_expand_group=8 \
  g16:run_expand_group=16 g4s1:run_expand_group=4,run_expand_group_stages=1 \
  g4s3:run_expand_group=4,run_expand_group_stages=3 g4w4:run_expand_group=4,run_expand_warps=4 \
  g8w4:run_expand_group=8,run_expand_warps=4 \
  --out "$out/groups.json" > "$out/groups.txt" 2>&1
echo "anatomy rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep "==" "$out/groups.txt"
best=$(python - "$out/groups.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
modes = [m for m in rows[0] if m.startswith("g")]
total = {m: sum(sum(r[m]) / len(r[m]) for r in rows) for m in modes}
print(min(total, key=total.get))
PY
)
echo "best group mode: $best" | tee -a "$out/rc.txt"
case $best in
  g2) set_knobs="triton-sgmv:run_expand_group=2" ;;
  g4) set_knobs="triton-sgmv:run_expand_group=4" ;;
  g8) set_knobs="triton-sgmv:run_expand_group=8" ;;
  g16) set_knobs="triton-sgmv:run_expand_group=16" ;;
  g4s1) set_knobs="triton-sgmv:run_expand_group=4 triton-sgmv:run_expand_group_stages=1" ;;
  g4s3) set_knobs="triton-sgmv:run_expand_group=4 triton-sgmv:run_expand_group_stages=3" ;;
  g4w4) set_knobs="triton-sgmv:run_expand_group=4 triton-sgmv:run_expand_warps=4" ;;
  g8w4) set_knobs="triton-sgmv:run_expand_group=8 triton-sgmv:run_expand_warps=4" ;;
  *) set_knobs="triton-sgmv:run_expand_group=4" ;;
esac
serve=(serving --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 192 --hf-batch 0 --sweep-rounds 2)
timeout 150 python -m mmlora.bench "${serve[@]}" --out "$out/serving_default" > "$out/serving_default.log" 2>&1
echo "serving default rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
# shellcheck disable=SC2086
timeout 150 python benchmarks/scripts/with_tuning.py $set_knobs -- "${serve[@]}" --out "$out/serving_group" \
  > "$out/serving_group.log" 2>&1
echo "serving $set_knobs rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
grep -h "tuning override\|mmlora \|base-only" "$out"/serving_*.log | sed 's/.*run\/s\]//'
