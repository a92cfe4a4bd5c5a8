# Sourced by device scripts after benchmarks/device_preamble.sh: issue 13's serving command (default backend,
# 8 / 32 / 1000 adapters, decode micro-benchmark, two sweep rounds) with the defaults (serving/), then a second
# arm, the two sharing what is left of the call's 590 s; both commands go to command.txt (after what is there).
# The second arm: with $knob set (a triton-sgmv TUNING override, KNOB=JSON, or any TABLE:KNOB=JSON that
# benchmarks/scripts/with_tuning.py takes), the override (knobs/); without it, the bench with the options in
# the array $extra (off/). $extra also goes to an override's arm. A script that sets the array $args first
# runs that bench command instead of issue 13's.
[[ -v args ]] || args=(serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 --num-requests 192
  --hf-batch 0 --micro-batch 32 128 --sweep-rounds 2)
extra=(${extra[@]+"${extra[@]}"})  # empty unless the script set it
echo "python -m mmlora.bench ${args[*]}" >> "$out/command.txt"
timeout $(((590 - SECONDS) / 2)) python -m mmlora.bench "${args[@]}" --out "$out/serving" > "$out/serving.log" 2>&1
echo "serving rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
if [[ -n ${knob:-} ]]; then
  [[ $knob == *:* ]] && override=$knob || override=triton-sgmv:$knob
  echo "python benchmarks/scripts/with_tuning.py $override -- ${args[*]} ${extra[*]}" >> "$out/command.txt"
  timeout $((590 - SECONDS)) python benchmarks/scripts/with_tuning.py "$override" -- "${args[@]}" \
    "${extra[@]}" --out "$out/knobs" > "$out/knobs.log" 2>&1
  echo "serving with $knob rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
else
  echo "python -m mmlora.bench ${args[*]} ${extra[*]}" >> "$out/command.txt"
  timeout $((590 - SECONDS)) python -m mmlora.bench "${args[@]}" "${extra[@]}" --out "$out/off" > "$out/off.log" 2>&1
  echo "serving with ${extra[*]} rc=$? at ${SECONDS} s" | tee -a "$out/summary.txt"
fi
