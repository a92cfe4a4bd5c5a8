"""Summary of `bench serving --workload shared-prefix` runs (issue 14): per on/off pair the ratios and each
side's step breakdown, then the worse pair against the targets.

    python benchmarks/scripts/prefix_summary.py OUTDIR RUN [RUN ...]   (reads OUTDIR/RUN/serving_prefix.json)
"""

import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
print((out / "rc.txt").read_text().strip())
for cap in sys.argv[2:]:
    path = out / cap / "serving_prefix.json"
    if not path.exists():
        print(f"{cap}: no JSON (see {cap}.log)")
        continue
    res = json.loads(path.read_text())
    print(
        f"== {cap}: max_running_requests {res['max_running_requests']}, kv_tokens {res['kv_tokens']}, "
        f"wall {res['wall_s']:.0f} s"
    )
    for row in res["results"]:
        for p in row["pairs"]:
            on, off = p["on"], p["off"]
            r = p["ratios"]
            print(
                f"  {row['workload']:13s} {p['order']:9s}: on {on['output_tok_per_s']:7.0f} / off "
                f"{off['output_tok_per_s']:7.0f} tok/s = {r['throughput_on_over_off']:.3f}x; TTFT p50 "
                f"{on['ttft_p50_s'] * 1e3:6.0f} / {off['ttft_p50_s'] * 1e3:6.0f} ms = "
                f"{r['ttft_p50_on_over_off']:.3f}; prefill {r['prefill_tokens_on_over_off']:.3f}; "
                f"preemptions {on['preemptions']}/{off['preemptions']}"
            )
            for side, run in (("on", on), ("off", off)):
                b = run["breakdown"]
                kinds = ", ".join(
                    f"{k} {v['count']}x {v['wall_s']:.2f}s" for k, v in b["step_kinds"].items() if v["count"]
                )
                host = ", ".join(f"{k} {v:.2f}" for k, v in b["host_phases_s"].items())
                print(
                    f"      {side:3s} {run['seconds']:.2f} s: {kinds}; host s: {host}; compiles {b['triton_compiles']}"
                )
        targets = res["targets"][row["workload"]]
        for k, (target, at_least) in targets.items():
            v = row["worse"][k]
            ok = v >= target if at_least else v <= target
            print(
                f"  {row['workload']}: {k} worse pair {v:.3f} (target {'>=' if at_least else '<='} {target}): "
                f"{'met' if ok else 'MISSED'}"
            )
