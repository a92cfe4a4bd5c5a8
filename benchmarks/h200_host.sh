#!/usr/bin/env bash
# Issue 13, host work of serving (one H200, bf16, dummy Mistral-7B, 192 requests, rank 16): the standard
# serving bench at base-only, 8, 32 and 1000 adapters (8 kept so that the adapter draws of 32 and 1000
# match session 3: one generator feeds every point), run twice, against session 3's two runs of the same
# command (benchmarks/results/h200-2026-12-01-session3/serving{1,2}, before this branch's changes:
# add_lora argument checks memoised, host launch arithmetic without Triton's constexpr wrappers,
# adapter uploads that no longer block the host).
# Usage: bash benchmarks/h200_host.sh OUTDIR        (about 3.5 minutes; one device call)
# Look at OUTDIR/summary.txt: per run and point, output tok/s and its ratio to base-only, host seconds of
# schedule / lora_host, mixed-step launch seconds, and adapter uploads (host s against GPU s: before,
# host ~= GPU because each upload blocked the host; uploads run inside schedule, whose 2.2 s at 1000
# adapters held 1.9 s of them).
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for i in 1 2; do
  timeout 170 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 8 32 1000 \
    --num-requests 192 --hf-batch 0 --micro-batch --allow-compiles --out "$out/serving$i" \
    > "$out/serving$i.log" 2>&1
  echo "serving$i rc=$?" | tee -a "$out/rc.txt"
done
python - "$out" > "$out/summary.txt" 2>&1 <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print((out / "rc.txt").read_text().strip())
before = Path("benchmarks/results/h200-2026-12-01-session3")
runs = [(f"before (session 3) {i}", before / f"serving{i}" / "serving.json") for i in (1, 2)]
runs += [(f"after {i}", out / f"serving{i}" / "serving.json") for i in (1, 2)]
for label, path in runs:
    if not path.exists():
        print(f"== {label}: no {path}")
        continue
    res = json.loads(path.read_text())
    base = next(r for r in res["runs"] if r["num_adapters"] == 0)["output_tok_per_s"]
    print(f"== {label} ({path})")
    for r in res["runs"]:
        if r["num_adapters"] not in (0, 32, 1000):
            continue
        b = r["breakdown"]
        host, up, mixed = b["host_phases_s"], b["adapter_uploads"], b["step_kinds"]["mixed"]
        print(f"  n={r['num_adapters']:5d}: {r['output_tok_per_s']:7.0f} tok/s ({r['output_tok_per_s'] / base:.2f}x base), "
              f"TTFT p50 {r['ttft_p50_s'] * 1e3:5.0f} ms; host s: schedule {host['schedule']:.2f}, lora_host "
              f"{host['lora_host']:.2f}, build {host['build_inputs']:.2f}; mixed {mixed['count']} steps wall "
              f"{mixed['wall_s']:.2f} launch {mixed['forward_launch_s']:.2f}; uploads {up['count']} host "
              f"{up['host_s']:.2f} gpu {up['gpu_s'] or 0:.2f} s")
PY
cat "$out/summary.txt"
