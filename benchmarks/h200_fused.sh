#!/usr/bin/env bash
# Issue 13 item 3, first measurement of the fused decode kernel (triton-fused: shrink and expand in one
# launch per module, an adapter read once per run of rows) against triton-auto (BGMV decode, SGMV
# prefill). One H200, bf16, dummy Mistral-7B, rank 16.
# 1. python -m mmlora.bench kernels --quick: bgmv / sgmv / fused per projection, token count and
#    popularity (grouped = uniform over 16 adapters, rows sorted by adapter as decode graphs order them).
# 2. python -m mmlora.bench serving at 32 adapters with its decode microbenchmark (B = 32, 128), auto and
#    fused alternating, twice each; every run has its own base-only point.
# Usage: bash benchmarks/h200_fused.sh OUTDIR        (about 8 minutes; one device call)
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 230 python -m mmlora.bench kernels --quick --ranks 16 --backends triton-bgmv triton-sgmv triton-fused \
  --out "$out/kernels" > "$out/kernels.log" 2>&1
echo "kernels rc=$?" | tee -a "$out/rc.txt"
for i in 1 2; do
  for backend in triton-auto triton-fused; do
    timeout 100 python -m mmlora.bench serving --model dummy:mistral-7b-v0.3 --num-adapters 32 \
      --num-requests 192 --hf-batch 0 --micro-batch 32 128 --allow-compiles --lora-backend "$backend" \
      --out "$out/serving-$backend-$i" > "$out/serving-$backend-$i.log" 2>&1
    echo "serving $backend $i rc=$?" | tee -a "$out/rc.txt"
  done
done
python - "$out" > "$out/summary.txt" 2>&1 <<'PY'
import json, sys
from collections import defaultdict
from pathlib import Path
out = Path(sys.argv[1])
print((out / "rc.txt").read_text().strip())
kern = out / "kernels" / "kernels.json"
if kern.exists():
    rows = json.loads(kern.read_text())["results"]
    table = defaultdict(dict)
    for r in rows:
        if r["phase"] == "decode":
            table[(r["proj"], r["tokens"], r["popularity"])][r["backend"]] = r["time_us"]
    print("decode add_lora us (bgmv / sgmv / fused):")
    for key, t in sorted(table.items()):
        print(f"  {key[0]:8s} T={key[1]:4d} {key[2]:9s} "
              + " / ".join(f"{t.get(b, float('nan')):7.1f}" for b in ("triton-bgmv", "triton-sgmv", "triton-fused")))
for path in sorted(out.glob("serving-*/serving.json")):
    res = json.loads(path.read_text())
    runs = {r["num_adapters"]: r for r in res["runs"]}
    base, lora = runs[0], runs[32]
    print(f"== {path.parent.name}: 32 adapters {lora['output_tok_per_s']:.0f} tok/s = "
          f"{lora['output_tok_per_s'] / base['output_tok_per_s']:.3f}x base-only ({base['output_tok_per_s']:.0f}); "
          f"TTFT p50 {lora['ttft_p50_s'] / base['ttft_p50_s']:.2f}x; TPOT p50 {lora['tpot_p50_s'] * 1e3:.1f} ms")
    print(f"   decode: {lora['mean_decode_batch']:.0f} rows, {lora['mean_distinct_adapters_per_decode_step']:.1f} adapters "
          f"per step; decode s {lora['decode_seconds']:.2f} vs base {base['decode_seconds']:.2f}")
    for m in res.get("decode_step") or []:
        print(f"   micro B={m['batch']} lora={m['lora']}: replay {m['graph_replay_ms']:.2f} ms "
              f"({m['replay_over_floor']:.2f}x floor), step {m['engine_step_ms']:.2f} ms")
PY
cat "$out/summary.txt"
