#!/usr/bin/env bash
# Session 10, call 1 (one H200), under 9.5 minutes: direct Triton launches (mmlora.triton_launch), issue 13.
#  1. GPU tests of the direct path (bit-equal to Triton's own launches, aligned, misaligned, in a graph),
#     then the Triton kernel tests (LoRA, fused ops, attention, graphs). Stops here if the first fails.
#  2. benchmarks/scripts/fast_launch_ab.py: host us per launch site and engine mixed steps (127 decode
#     rows + a 260-token prompt), direct against Triton's path, alternating in one process.
#  3. The serving command, --sweep-rounds 2, in one process (start-up objects frozen out of
#     Python's collector after the warm-up, as the server now does; the breakdown counts collections).
# Usage: bash benchmarks/h200_session10.sh OUTDIR (calls 1 and 2)
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 60 python -m pytest -q -p no:cacheprovider tests/kernels/test_triton_launch.py > "$out/launch_tests.txt" 2>&1
rc=$?
echo "launch tests rc=$rc at ${SECONDS} s" | tee "$out/rc.txt"
if [ "$rc" -ne 0 ]; then tail -30 "$out/launch_tests.txt"; exit 1; fi
timeout 110 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_lora_kernels.py tests/kernels/test_fused_ops.py \
  tests/kernels/test_attention.py tests/kernels/test_fused_decode.py tests/kernels/test_cuda_graph.py > "$out/tests.txt" 2>&1
echo "kernel tests rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
timeout 150 python benchmarks/scripts/fast_launch_ab.py --out "$out/fast_launch_ab.json" > "$out/fast_launch_ab.txt" 2>&1
echo "fast launch a/b rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
left=$((560 - SECONDS))
if [ "$left" -gt 200 ]; then
  timeout "$left" python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
    --num-requests 192 --hf-batch 0 --sweep-rounds 2 --allow-compiles --out "$out/rounds" > "$out/rounds.log" 2>&1
  echo "rounds rc=$? at ${SECONDS} s" | tee -a "$out/rc.txt"
fi
python benchmarks/scripts/serving_summary.py "$out" rounds > "$out/summary.txt" 2>&1
tail -3 "$out/launch_tests.txt" "$out/tests.txt"
cat "$out/fast_launch_ab.txt" | grep -v Warning | tail -12
cat "$out/summary.txt"
