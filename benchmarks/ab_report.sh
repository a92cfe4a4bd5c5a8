# Sourced at the end of device scripts (after benchmarks/device_preamble.sh): the failures in tests.txt, any
# error in the logs and graphs_ab.txt, the decode-graph A/B's rounds and its token comparison, then the
# summaries of the serving runs named in $runs (subfolders of $out).
grep -E "^(FAILED|ERROR)" "$out/tests.txt" | head -8
grep -ihE "Error|Traceback" "$out"/*.log "$out/graphs_ab.txt" | head -6
grep -o "B=[0-9]* round.\{0,420\}" "$out/graphs_ab.txt"
grep -h "^B=[0-9]*:" "$out/graphs_ab.txt" | cut -c1-300
# shellcheck disable=SC2086
python benchmarks/scripts/serving_summary.py "$out" ${runs:-serving knobs} 2>&1 | head -60
true
