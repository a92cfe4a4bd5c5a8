# Sourced by device scripts after benchmarks/device_preamble.sh, with $knob set (a triton-sgmv TUNING
# override, KNOB=JSON, or any TABLE:KNOB=JSON that benchmarks/scripts/with_tuning.py takes) and, if the
# override's arm needs more options, the array $extra: issue 13's serving command (default backend,
# 8 / 32 / 1000 adapters, decode micro-benchmark, two sweep rounds) with the defaults, then with the
# override, the two sharing what is left of the call's 590 s; both commands go to command.txt (after what
# is there), the runs to serving/ and knobs/. A script that sets the array $args first runs that bench
# command instead of issue 13's.
[[ -v args ]] || args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 --num-requests 192
  --hf-batch 0 --micro-batch 32 128 --sweep-rounds 2)
[[ $knob == *:* ]] && override=$knob || override=triton-sgmv:$knob
extra=(${extra[@]+"${extra[@]}"})  # empty unless the script set it
echo "python -m mmlora.bench ${args[*]}" >> "$out/command.txt"
echo "python benchmarks/scripts/with_tuning.py $override -- ${args[*]} ${extra[*]}" >> "$out/command.txt"
timeout $(((590 - SECONDS) / 2)) python -m mmlora.bench "${args[@]}" --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
timeout $((590 - SECONDS)) python benchmarks/scripts/with_tuning.py "$override" -- "${args[@]}" \
  "${extra[@]}" --out "$out/knobs" > "$out/knobs.log" 2>&1
echo "serving with $knob rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
