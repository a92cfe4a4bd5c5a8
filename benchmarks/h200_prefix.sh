#!/usr/bin/env bash
# Issue 14 on one H200 (bf16, dummy Mistral-7B, 32 rank-16 adapters): the prefix cache on against off.
# Usage: bash benchmarks/h200_prefix.sh OUTDIR        (about 4 minutes; one device call)
#   run 1, --max-running-requests 128 (the conditions of the session-3 figures, 1.86-1.94x):
#          shared-prefix (256 requests, 1024-token system prompt per adapter, 64 in / 128 out) and the
#          no-sharing workload; each: untimed warm-up, then two on/off pairs, on first then off first.
#   run 2, --max-running-requests 256: the shared-prefix workload alone, so its 256 requests run in one
#          wave for the cache on and off alike (at 128 the TTFT p50 falls between two waves).
# Writes OUTDIR/cap128/serving_prefix.json, OUTDIR/cap256/serving_prefix.json (each timed run with its
# step breakdown), the logs, and OUTDIR/summary.txt (per pair ratios, worse pair against the targets).
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
common=(--workload shared-prefix --model dummy:mistral-7b-v0.3 --num-adapters 32 --num-requests 256
        --shared-prefix 1024 64 128 --repeats 2)
timeout 170 python -m mmlora.bench serving "${common[@]}" --max-running-requests 128 \
  --out "$out/cap128" > "$out/cap128.log" 2>&1
echo "cap128 rc=$?" | tee "$out/rc.txt"
timeout 110 python -m mmlora.bench serving "${common[@]}" --max-running-requests 256 \
  --prefix-workloads shared-prefix --out "$out/cap256" > "$out/cap256.log" 2>&1
echo "cap256 rc=$?" | tee -a "$out/rc.txt"
python - "$out" > "$out/summary.txt" 2>&1 <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print((out / "rc.txt").read_text().strip())
for cap in ("cap128", "cap256"):
    path = out / cap / "serving_prefix.json"
    if not path.exists():
        print(f"{cap}: no JSON (see {cap}.log)")
        continue
    res = json.loads(path.read_text())
    print(f"== {cap}: max_running_requests {res['max_running_requests']}, kv_tokens {res['kv_tokens']}, "
          f"wall {res['wall_s']:.0f} s")
    for row in res["results"]:
        for p in row["pairs"]:
            on, off = p["on"], p["off"]
            r = p["ratios"]
            print(f"  {row['workload']:13s} {p['order']:9s}: on {on['output_tok_per_s']:7.0f} / off "
                  f"{off['output_tok_per_s']:7.0f} tok/s = {r['throughput_on_over_off']:.3f}x; TTFT p50 "
                  f"{on['ttft_p50_s'] * 1e3:6.0f} / {off['ttft_p50_s'] * 1e3:6.0f} ms = "
                  f"{r['ttft_p50_on_over_off']:.3f}; prefill {r['prefill_tokens_on_over_off']:.3f}; "
                  f"preemptions {on['preemptions']}/{off['preemptions']}")
            for side, run in (("on", on), ("off", off)):
                b = run["breakdown"]
                kinds = ", ".join(f"{k} {v['count']}x {v['wall_s']:.2f}s" for k, v in b["step_kinds"].items() if v["count"])
                host = ", ".join(f"{k} {v:.2f}" for k, v in b["host_phases_s"].items())
                print(f"      {side:3s} {run['seconds']:.2f} s: {kinds}; host s: {host}; compiles {b['triton_compiles']}")
        targets = res["targets"][row["workload"]]
        for k, (target, at_least) in targets.items():
            v = row["worse"][k]
            ok = v >= target if at_least else v <= target
            print(f"  {row['workload']}: {k} worse pair {v:.3f} (target {'>=' if at_least else '<='} {target}): "
                  f"{'met' if ok else 'MISSED'}")
PY
cat "$out/summary.txt"
