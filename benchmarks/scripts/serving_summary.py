"""Summary lines of ``bench serving`` runs in one device call's output folder (the H200 scripts' last step).

    python benchmarks/scripts/serving_summary.py OUTDIR RUN [RUN ...]

For each RUN (a subfolder holding ``serving.json``, or ``serving.partial.json`` when the run was cut
short): base-only tok/s, then per adapter count the ratio to base-only, TTFT p50 ratio, decode seconds,
the decode-graph and mixed-step GPU spans, adapter uploads, and the decode microbenchmark rows (with each
graph layout's replay when timed). Also prints ``rc.txt`` and the last lines of ``tests.txt``.
"""

import json
import sys
from pathlib import Path


def main(out: Path, names: list[str]) -> None:
    print((out / "rc.txt").read_text().strip())
    tests = out / "tests.txt"
    if tests.exists():
        print(tests.read_text().strip().splitlines()[-2:])
    for name in names:
        path = out / name / "serving.json"
        if not path.exists():
            path = out / name / "serving.partial.json"
        if not path.exists():
            print(f"== {name}: no result")
            continue
        res = json.loads(path.read_text())
        runs = {r["num_adapters"]: r for r in res["runs"]}
        base = runs[0]

        def kinds(r: dict) -> dict:
            return r.get("breakdown", {}).get("step_kinds", {})

        base_span = kinds(base).get("decode_graph", {}).get("gpu_span_s", 0)
        print(
            f"== {name}: base-only {base['output_tok_per_s']:.0f} tok/s, TTFT p50 "
            f"{base['ttft_p50_s'] * 1e3:.0f} ms, decode {base['decode_seconds']:.2f} s"
        )
        for n, r in sorted(runs.items()):
            if not n:
                continue
            dg, mx = kinds(r).get("decode_graph", {}), kinds(r).get("mixed", {})
            up = r.get("breakdown", {}).get("adapter_uploads", {})
            print(
                f"  n={n:5d}: {r['output_tok_per_s']:.0f} tok/s = "
                f"{r['output_tok_per_s'] / base['output_tok_per_s']:.3f}x base; "
                f"TTFT p50 {r['ttft_p50_s'] / base['ttft_p50_s']:.2f}x; decode {r['decode_seconds']:.2f} s "
                f"(graph span {dg.get('gpu_span_s', 0):.2f} s vs base {base_span:.2f}); "
                f"mixed span {mx.get('gpu_span_s', 0):.2f} s; uploads {up.get('count')} host "
                f"{up.get('host_s', 0):.2f} gpu {up.get('gpu_s') or 0:.2f} s"
            )
        for m in res.get("decode_step") or []:
            if "skipped" in m or m.get("graph_replay_ms") is None:
                print(f"  micro {m}")
                continue
            print(
                f"  micro B={m['batch']} lora={m['lora']}: replay {m['graph_replay_ms']:.2f} ms "
                f"({m['replay_over_floor']:.2f}x floor), step {m['engine_step_ms']:.2f} ms, "
                f"{m.get('distinct_adapters')} adapters, by layout {m.get('graph_replay_ms_by_layout')}"
            )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
