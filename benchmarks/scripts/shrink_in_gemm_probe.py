"""Issue 13: what would the decode LoRA shrink cost if it rode on the base GEMM?

The decode LoRA shrinks take about 22 us a layer at serving's batches (B=72 on 24 adapters, H100, session
35), reading the adapters' A at about 1.3 TB/s. On CPU the torch-gather backend already computes the
shrink inside the base GEMM, over the module's stacked ``[W; A]``. On the GPU that would put ``E`` more
output rows on cuBLAS's GEMM (every staged slot's rank rows), whose cost here is the question: if cuBLAS
reads them at its own rate (about 3 TB/s), the shrink's launches go and a few us of bytes remain.

The probe, on the GPU alone (no engine): Mistral-7B's four projections at bf16, ``F.linear(x, W_cat[:N + E])``
for B in ``--batches`` and E = slots x slices x rank for ``--slots`` and ``--ranks``, in CUDA graphs over
``--layers`` distinct weight copies (so no layer's weight sits in L2), two rounds. Prints per batch and E
the four GEMMs' us a layer, the increase over E=0, the rate the extra bytes were read at, and the four
shrinks as GEMMs of their own over the stacked A alone (``alone``: one cuBLAS launch a module, no ``[W; A]``
storage); writes JSON.

    PYTHONPATH=. python benchmarks/scripts/shrink_in_gemm_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json

import torch

MODULES = {
    "qkv": (6144, 4096, 3),
    "o": (4096, 4096, 1),
    "gate_up": (28672, 4096, 2),
    "down": (4096, 14336, 1),
}


def _replay_us(graph: torch.cuda.CUDAGraph, calls: int, reps: int = 20) -> float:
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def _gemm_us(x: torch.Tensor, weights: list[torch.Tensor], rows: int) -> float:
    """One GEMM's us: F.linear of x with each weight's first ``rows`` rows, replayed in one graph."""
    outs = [torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device) for _ in weights]
    for w, o in zip(weights, outs):  # warm cuBLAS's choice outside the capture
        torch.matmul(x, w[:rows].T, out=o)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w, o in zip(weights, outs):
            torch.matmul(x, w[:rows].T, out=o)
    return _replay_us(graph, len(weights))


def probe(args: argparse.Namespace) -> dict:
    dev = torch.device("cuda")
    extras = sorted({s * r for s in args.slots for r in args.ranks} | {0})
    rows: list[dict] = []
    for name, (N, K, n) in MODULES.items():
        top = N + max(extras) * n
        weights = [torch.randn(top, K, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(args.layers)]
        for B in args.batches:
            x = torch.randn(B, K, dtype=torch.bfloat16, device=dev)
            for rnd in range(args.rounds):
                for e in extras:
                    us = _gemm_us(x, weights, N + e * n)
                    # The shrink alone as one cuBLAS GEMM over the stacked A (no [W; A] storage needed).
                    sep = _gemm_us(x, [w[N:] for w in weights], e * n) if e else 0.0
                    rows.append(
                        {"module": name, "B": B, "extra_rank_rows": e, "E": e * n, "round": rnd, "us": us}
                        | {"sep_us": sep}
                    )
        del weights
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "rows": rows, "extras": extras, "args": vars(args)}


def report(result: dict) -> None:
    rows = result["rows"]
    worst: dict[tuple, float] = {}
    alone: dict[tuple, float] = {}  # the shrink as its own cuBLAS GEMM
    for r in rows:
        key = (r["B"], r["extra_rank_rows"], r["module"])
        worst[key] = max(worst.get(key, 0.0), r["us"])
        alone[key] = max(alone.get(key, 0.0), r.get("sep_us", 0.0))
    batches = sorted({r["B"] for r in rows})
    print(f"device: {result['device']}; us a layer (four GEMMs), worse of the rounds")
    print(
        f"{'B':>5} {'slots x rank':>13} {'qkv':>7} {'o':>7} {'gate_up':>8} {'down':>7} {'layer':>8} {'+us':>7}"
        f" {'TB/s':>6} {'alone':>7}"
    )
    for B in batches:
        base = sum(worst[(B, 0, m)] for m in MODULES)
        for e in result["extras"]:
            per = [worst[(B, e, m)] for m in MODULES]
            layer = sum(per)
            extra_bytes = sum(e * n * K * 2 for (_, K, n) in MODULES.values())
            plus = layer - base
            rate = extra_bytes / (plus * 1e-6) / 1e12 if plus > 0.05 else float("inf")
            print(
                f"{B:>5} {e:>13} {per[0]:>7.1f} {per[1]:>7.1f} {per[2]:>8.1f} {per[3]:>7.1f} {layer:>8.1f}"
                f" {plus:>7.1f} {rate:>6.2f} {sum(alone[(B, e, m)] for m in MODULES):>7.1f}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[32, 72, 128])
    p.add_argument("--slots", type=int, nargs="+", default=[8, 24, 32, 64])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = probe(args)
    report(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
