"""Summary lines of ``bench serving`` runs in one device call's output folder (the H200 scripts' last step).

    python benchmarks/scripts/serving_summary.py OUTDIR RUN [RUN ...]

For each RUN (a subfolder holding ``serving.json``, or ``serving.partial.json`` when the run was cut
short): the engine's memory (KV cache tokens, adapter slot and stage bytes; finished runs), base-only tok/s
and mean decode batch, then per adapter count the ratio to base-only, TTFT p50 ratio, decode seconds,
the decode-graph and mixed-step GPU spans, adapter uploads, and the decode microbenchmark rows (with each
graph layout's replay when timed); a run of several rounds (``--sweep-rounds``) gets a block per round,
each against its own round's base-only run. Also prints ``rc.txt``, the last lines of ``tests.txt``, and
the SM clock and throttle reasons seen in ``gpu_log.csv`` (nvidia-smi's CSV log) when there is one.
"""

import json
import sys
from pathlib import Path

from mmlora.bench.serving_parts import describe_memory


def main(out: Path, names: list[str]) -> None:
    if (out / "rc.txt").exists():
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
        if "memory" in res:  # a finished run's engine: KV cache tokens, adapter slot and stage bytes
            print(f"== {name}: {describe_memory(res['memory'])}")
        rounds = sorted({r.get("round", 0) for r in res["runs"]})
        for k in rounds:
            # A sweep over rank mixes (``--rank-mixes``) has one run per adapter count and mix.
            runs = {
                (r["num_adapters"], tuple(r.get("ranks") or ())): r
                for r in res["runs"]
                if r.get("round", 0) == k
            }
            label = name if len(rounds) == 1 else f"{name} round {k + 1}"
            if any(n == 0 for n, _ in runs):
                _round(label, runs)
        _micro(res)
    _clocks(out / "gpu_log.csv")


def _round(name: str, runs: dict) -> None:
    """One round's lines: ``runs`` keyed by (adapter count, rank mix), base-only at count 0."""
    base = next(r for (n, _), r in runs.items() if n == 0)

    def kinds(r: dict) -> dict:
        return r.get("breakdown", {}).get("step_kinds", {})

    def mixed(r: dict) -> dict:  # eager mixed steps and those replayed from graphs (since session 24)
        parts = [kinds(r).get(k, {}) for k in ("mixed", "mixed_graph")]
        return {f: sum(p.get(f) or 0 for p in parts) for f in ("wall_s", "forward_launch_s", "gpu_span_s")}

    def gc_s(r: dict) -> str:
        g = r.get("breakdown", {}).get("python_gc")
        return "-" if g is None else f"{g['total_s']:.2f} s ({g['collections'][2]} full)"

    base_span = kinds(base).get("decode_graph", {}).get("gpu_span_s", 0)
    bmx = mixed(base)
    print(
        f"== {name}: base-only {base['output_tok_per_s']:.0f} tok/s, TTFT p50 "
        f"{base['ttft_p50_s'] * 1e3:.0f} ms, decode {base['decode_seconds']:.2f} s "
        f"({base.get('mean_decode_batch', 0):.1f} requests a step), mixed wall "
        f"{bmx.get('wall_s', 0):.2f} s (launch {bmx.get('forward_launch_s', 0):.2f}); python gc {gc_s(base)}"
    )
    mixes = {ranks for n, ranks in runs if n}
    for (n, ranks), r in sorted(runs.items()):
        if not n:
            continue
        dg, mx = kinds(r).get("decode_graph", {}), mixed(r)
        up = r.get("breakdown", {}).get("adapter_uploads", {})
        mix = f" ranks {','.join(map(str, ranks))}" if len(mixes) > 1 else ""
        print(
            f"  n={n:5d}{mix}: {r['output_tok_per_s']:.0f} tok/s = "
            f"{r['output_tok_per_s'] / base['output_tok_per_s']:.3f}x base; "
            f"TTFT p50 {r['ttft_p50_s'] / base['ttft_p50_s']:.2f}x; decode bytes bound "
            f"{base['decode_floor_seconds'] / r['decode_floor_seconds']:.3f}x; decode {r['decode_seconds']:.2f} s "
            f"(graph span {dg.get('gpu_span_s', 0):.2f} s vs base {base_span:.2f}); "
            f"mixed wall {mx.get('wall_s', 0):.2f} s (launch {mx.get('forward_launch_s', 0):.2f}, span "
            f"{mx.get('gpu_span_s', 0):.2f}); uploads {up.get('count')} host "
            f"{up.get('host_s', 0):.2f} gpu {up.get('gpu_s') or 0:.2f} s; python gc {gc_s(r)}"
            + (f"; LoRA replays {r['lora_replays']}" if r.get("lora_replays") else "")
        )


def _micro(res: dict) -> None:
    for m in res.get("decode_step") or []:
        if "skipped" in m or m.get("graph_replay_ms") is None:
            print(f"  micro {m}")
            continue
        print(
            f"  micro B={m['batch']} lora={m['lora']}: replay {m['graph_replay_ms']:.2f} ms "
            f"({m['replay_over_floor']:.2f}x floor), step {m['engine_step_ms']:.2f} ms{_steady(m)}, "
            f"{m.get('distinct_adapters')} adapters, by layout {m.get('graph_replay_ms_by_layout')}"
        )


def _steady(m: dict) -> str:
    """The steady-state step (runs since session 32 have it: ``mean_step_seconds(..., drain=False)``)."""
    steady = m.get("engine_step_steady_ms")
    return "" if steady is None else f" (steady {steady:.2f} ms)"


def _clocks(path: Path) -> None:
    """SM clock (MHz) min / median / max over the log, and the throttle reasons seen."""
    if not path.exists():
        return
    rows = [line.split(", ") for line in path.read_text().splitlines()[1:] if line.count(",") >= 5]
    clocks = sorted(int(r[1].split()[0]) for r in rows if r[1].split()[0].isdigit())
    if not clocks:
        return
    reasons = sorted({r[5].strip() for r in rows})
    print(
        f"== GPU log: {len(clocks)} samples, SM clock min {clocks[0]} / median {clocks[len(clocks) // 2]} / "
        f"max {clocks[-1]} MHz; throttle reasons seen: {reasons}"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
