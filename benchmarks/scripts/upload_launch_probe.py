"""Issue 13: do adapter uploads in flight hold the host while it launches a step?

In issue 13's serving runs, the mixed steps' launch time (``forward_launch_s``: host seconds inside the
forward call) follows the run's adapter uploads (``launch_by_uploads.py``): 0.12-0.26 s in the 46 committed
runs without uploads, 0.33-0.39 s in every 1000-adapter run with 115 and 0.65-0.88 s with 173 (the GPU wait
shrank by less). An upload is one ~84 MB host-to-device copy from pinned memory on the pool's upload stream
(then device-side scatters). A mixed step's launch makes several small host-to-device copies from pageable
memory (its inputs, the LoRA routing) before and after its graph replay. The suspicion: a pageable copy goes through the driver's staging buffers, whose DMA
queues behind the uploads' on the copy engine, so the host waits for the uploads.

The probe, on the GPU alone (no engine): a burst of ``--uploads`` copies of ``--upload-mb`` MB each
(pinned, one stream, as the pool's uploads; also cut into 4 MB pieces), then at once, on the main stream,
timed on the host: small pageable copies, the same from pinned memory (``torch.tensor(..., pin_memory=
True)``), a kernel launch and the replays of a small CUDA graph and of one of 2048 kernels (a mixed step's
size); also with each upload scattered device-side as the pool's are; and on the GPU (events): when the
main stream's small copies completed, counted from the burst's start. Each without a burst first. Three rounds.

    PYTHONPATH=. python benchmarks/scripts/upload_launch_probe.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SIZES = (256, 4096, 32768)  # bytes of a step's input copies: routing, ids and positions, block tables


def _burst(
    stream: torch.cuda.Stream, dst: list[torch.Tensor], src: list[torch.Tensor], piece: int, scatter: bool
) -> None:
    """Each upload: its pinned bytes copied to the device in pieces of ``piece`` bytes and, with
    ``scatter``, then scattered device-side in 1,300 pieces by multi-tensor copies, as the pool's slot
    writes are (an adapter touches every layer's and module's buffer)."""
    with torch.cuda.stream(stream):
        for d, s in zip(dst, src):
            for at in range(0, s.numel(), piece):
                d[at : at + piece].copy_(s[at : at + piece], non_blocking=True)
            if scatter:
                half = d.numel() // 2
                parts = torch.tensor_split(d[:half], 1300)
                torch._foreach_copy_(list(torch.tensor_split(d[half : 2 * half], 1300)), list(parts))


def _host_ms(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def probe(args: argparse.Namespace) -> list[dict]:
    dev = torch.device("cuda")
    n = args.upload_mb << 20
    src = [torch.ones(n, dtype=torch.uint8, pin_memory=True) for _ in range(args.uploads)]
    dst = [torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(args.uploads)]
    targets = {size: torch.empty(size // 4, dtype=torch.int32, device=dev) for size in SIZES}
    values = {size: list(range(size // 4)) for size in SIZES}
    upload_stream = torch.cuda.Stream(dev)
    x = torch.randn(4096, device=dev)
    graphs = {}
    for nodes in (64, 2048):  # a small graph, and one of a mixed step's size (32 layers of ~60 kernels)
        graphs[nodes] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[nodes]):
            for _ in range(nodes):
                x.mul_(1.0)
    torch.cuda.synchronize()
    rows = []
    for rnd in range(args.rounds):
        for burst in ("none", "whole", "pieces", "whole+scatter"):
            row: dict = {"round": rnd, "burst": burst}
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record(upload_stream)
            if burst != "none":
                row["burst_enqueue_ms"] = _host_ms(
                    lambda b=burst: _burst(
                        upload_stream, dst, src, 4 << 20 if b == "pieces" else n, b.endswith("scatter")
                    )
                )
            done = torch.cuda.Event(enable_timing=True)
            done.record(upload_stream)
            torch.cuda.current_stream().wait_event(start)  # the main stream's clock starts with the burst
            for size in SIZES:
                row[f"pageable_{size}_ms"] = _host_ms(
                    lambda s=size: targets[s].copy_(
                        torch.tensor(values[s], dtype=torch.int32), non_blocking=True
                    )
                )
            copied = torch.cuda.Event(enable_timing=True)
            copied.record()
            for size in SIZES:
                row[f"pinned_{size}_ms"] = _host_ms(
                    lambda s=size: targets[s].copy_(
                        torch.tensor(values[s], dtype=torch.int32, pin_memory=True), non_blocking=True
                    )
                )
            pinned_copied = torch.cuda.Event(enable_timing=True)
            pinned_copied.record()
            row["kernel_launch_ms"] = _host_ms(lambda: x.add_(1.0))
            for nodes, graph in graphs.items():
                row[f"graph_{nodes}_replay_ms"] = _host_ms(graph.replay)
            torch.cuda.synchronize()
            row["gpu_pageable_copies_done_ms"] = start.elapsed_time(copied)
            row["gpu_pinned_copies_done_ms"] = start.elapsed_time(pinned_copied)
            row["gpu_burst_done_ms"] = start.elapsed_time(done)
            rows.append(row)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--uploads", type=int, default=8, help="copies in the burst (an adapter each)")
    p.add_argument("--upload-mb", type=int, default=84, help="MB a copy (a rank-16 Mistral-7B adapter: 84)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = probe(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"uploads": args.uploads, "upload_mb": args.upload_mb, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
