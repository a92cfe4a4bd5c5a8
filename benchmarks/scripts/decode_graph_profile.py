"""Issue 13: where a whole decode step's GPU time goes, base-only against LoRA, in the graphs serving replays.

One engine (dummy Mistral-7B, bf16, --adapters rank-16 adapters), decode batches at context ~780 (serving's
mean): for each --point B:DISTINCT, B base-only rows, then B rows cycling over DISTINCT adapters. Each
batch's decode graph (the one the engine step picked) is timed as replay (median of 5 x 20) and profiled
over 10 replays with torch.profiler: GPU time per kernel class (GEMM; attention with the KV store; LoRA;
small: norms, rotary, activation, elementwise; other) and per kernel name, launches per replay, and the
time no kernel runs (the replay span minus the union of kernel intervals: launch gaps and dependency
waits inside the graph). The floor is the weights' and KV bytes
at the copy bandwidth measured here (adapter bytes not included).

    PYTHONPATH=. python benchmarks/scripts/decode_graph_profile.py --point 32:32 72:24 128:32 --out F.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict

import numpy as np
import torch
from lora_overlap_ab import engine_with_adapters

from mmlora.bench.serving_parts import abort_all, copy_bandwidth, start_decode_batch, weight_bytes
from mmlora.kvcache.allocator import KVCache

CLASSES = (  # first match wins
    ("lora", re.compile(r"sgmv|bgmv|lora", re.I)),
    ("attention", re.compile(r"attn|attention|flash|_decode_split|_decode_reduce|_store_kv", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|cublas", re.I)),
    ("small", re.compile(r"norm|rope|act_and_mul|elementwise|vectorized", re.I)),
)


def kernel_class(name: str) -> str:
    return next((label for label, pattern in CLASSES if pattern.search(name)), "other")


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    times = []
    graph.replay()
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 20)
    return statistics.median(times)


def profile_replays(graph: torch.cuda.CUDAGraph, replays: int = 10) -> dict:
    """Per replay: GPU us by kernel class and by name, launches, and the idle us inside each replay's span."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()  # keeps replays apart, so each span is one replay's
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memcpy")
    )
    if not kernels:
        raise SystemExit(
            "the profiler saw no kernels of the graph replays (CUPTI without graph kernel records?)"
        )
    # Replays are separated by host syncs (tens of us); split where a gap exceeds the largest in-graph gap.
    spans, current = [], [kernels[0]]
    for k in kernels[1:]:
        if k[0] - max(e for _, e, _ in current) > 50.0:
            spans.append(current)
            current = [k]
        else:
            current.append(k)
    spans.append(current)
    by_class: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    idle, span_us = [], []
    for span in spans:
        busy, cursor = 0.0, span[0][0]
        for start, end, name in span:
            by_class[kernel_class(name)] += end - start
            by_name[name][0] += end - start
            by_name[name][1] += 1
            if end > cursor:
                busy += end - max(start, cursor)
                cursor = end
        total = max(e for _, e, _ in span) - span[0][0]
        span_us.append(total)
        idle.append(total - busy)
    n = len(spans)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "replays_seen": n,
        "span_us": statistics.median(span_us),
        "idle_us": statistics.median(idle),
        "launches": len(kernels) / n,
        "class_us": {c: round(t / n, 1) for c, t in sorted(by_class.items())},
        "top": [(name[:100], round(t / n, 1), c / n) for name, (t, c) in top],
    }


def measure(engine, names: list, context: int, rng, floor_bytes) -> dict:  # noqa: ANN001
    rids = start_decode_batch(engine, names, context, rng)
    engine.step()
    graphs = engine.runner.decode_graphs
    key = graphs.last_key
    graph = graphs.graphs[key].graph
    ctx = sum(r.num_computed + 1 for r in engine.scheduler.running)
    row = {"key": [str(k) for k in key], "replay_ms": replay_ms(graph), "floor_ms": floor_bytes(ctx) * 1e3}
    row.update(profile_replays(graph))
    row["replay_ms_after"] = replay_ms(graph)
    abort_all(engine, rids)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:mistral-7b-v0.3")
    p.add_argument("--point", nargs="+", default=["32:32", "72:24", "128:32"], help="B:DISTINCT_ADAPTERS")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--context", type=int, default=780)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    points = [tuple(int(v) for v in s.split(":")) for s in args.point]
    engine, _, adapters = engine_with_adapters(args.model, max(b for b, _ in points), args.adapters)
    bw = copy_bandwidth(torch.device("cuda"))
    weights = weight_bytes(engine.model)  # as serving's floor counts them
    attn = engine.model.layers[0].self_attn
    per_token = KVCache.bytes_per_token(
        len(engine.model.layers), attn.num_kv_heads, attn.head_dim, torch.bfloat16
    )
    rng = np.random.default_rng(0)
    rows = []
    for bsz, distinct in points:
        for lora in (False, True):
            names = [adapters[i % distinct]["name"] if lora else None for i in range(bsz)]
            row = {"batch": bsz, "distinct": distinct if lora else 0}
            row.update(
                measure(engine, names, args.context, rng, lambda ctx: (weights + ctx * per_token) / bw)
            )
            rows.append(row)
            print(
                f"== B={bsz} distinct={row['distinct']}: replay {row['replay_ms']:.3f}/{row['replay_ms_after']:.3f}"
                f" ms, floor {row['floor_ms']:.3f} ms, span {row['span_us']:.0f} us, idle {row['idle_us']:.0f} us,"
                f" {row['launches']:.0f} launches; by class {row['class_us']}",
                flush=True,
            )
            for name, us, count in row["top"]:
                print(f"   {us:8.1f} us  x{count:5.0f}  {name}")
    with open(args.out, "w") as f:
        json.dump(
            {"model": args.model, "copy_bw": bw, "weights_bytes": weights, "rows": rows,
             "torch": torch.__version__, "device": torch.cuda.get_device_name()},
            f, indent=1,
        )  # fmt: skip


if __name__ == "__main__":
    main()
