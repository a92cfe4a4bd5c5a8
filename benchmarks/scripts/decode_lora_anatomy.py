"""Where the LoRA kernels' time goes in the batches serving launches (issue 13, item 3): per projection and
per kernel, against the floor of their bytes at copy bandwidth.

Cases (Mistral-7B projections, bf16, rank ``--rank``; built by ``lora_tuning_sweep._points``):
- ``decode-runs`` B=128 and B=256 on 32 adapters: SGMV over runs of rows, as triton-auto replays decode
  graphs, with the segment entries it captures (B // 2) and with exactly the batch's runs;
- ``decode-rows`` B=32 on 32 adapters and B=128 on 128: BGMV, one row per segment;
- ``mixed`` (128 decode rows on 32 adapters and a 2048-token chunk), ``mixed-sorted`` (the same with the
  decode rows side by side per adapter, so they form runs) and ``prefill`` (4096 tokens over 8).

Per case: ``add_lora`` summed over the four projections, replayed in CUDA graphs over rotated adapter
copies (``mmlora.bench.kernels``), in two rounds, and in any ``--mode`` (backend TUNING overrides); each
kernel's own GPU time (torch.profiler over eager calls); and the floor: adapter + activation bytes over the
copy bandwidth measured in this run. Writes ``--out`` (JSON) and prints a table. ``--smoke``: tiny shapes on CPU under
``TRITON_INTERPRET=1`` (no profiler, no floor), to check the script.

    PYTHONPATH=. python benchmarks/scripts/decode_lora_anatomy.py --out anatomy.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lora_tuning_sweep as sweep  # noqa: E402

from mmlora.backends import get_backend, triton_bgmv, triton_fused_decode, triton_sgmv  # noqa: E402
from mmlora.bench.serving_parts import copy_bandwidth  # noqa: E402
from mmlora.forward.lora import page_weights, slot_runs  # noqa: E402

CASES = [  # (case, B, adapters, segment entries or None for B // 2 or "runs" for the batch's runs)
    ("decode-runs", 128, 32, None),
    ("decode-runs", 128, 32, "runs"),
    ("decode-runs", 256, 32, None),
    ("decode-runs", 256, 32, "runs"),
    ("decode-rows", 32, 32, None),
    ("decode-rows", 128, 32, None),
    ("decode-rows", 128, 128, None),
    ("mixed", 128, 32, None),
    ("mixed-sorted", 128, 32, None),
    ("prefill", 0, 8, None),
]
SMOKE_CASES = [
    ("decode-runs", 8, 2, None),
    ("decode-runs", 8, 2, "runs"),
    ("decode-rows", 8, 2, None),
    ("mixed-sorted", 8, 2, None),
]


def _tight_runs(points: list, bound: int) -> int:
    """Refill the decode-runs points' infos with exactly as many segment entries as their batch has runs
    (instead of B // 2); returns that count."""
    for pt in points:
        for info in pt.infos:
            rows = info.token_slots[: info.num_tokens].tolist()
            runs = slot_runs(rows)
            info.fill_rows(rows, bound, "runs", segments=len(runs), runs=runs)
    return points[0].infos[0].num_segments


def _one_row_a_segment(points: list) -> None:
    """Refill the decode points' infos in the ``rows`` layout (one segment a row): the fused decode
    kernel's graph layout, where it finds the runs itself."""
    for pt in points:
        for info in pt.infos:
            info.fill_rows(info.token_slots[: info.num_tokens].tolist(), info.rank_bound, "rows")


def _kernel_times(backend, points: list, calls: int = 20) -> dict[str, float]:  # noqa: ANN001
    """Microseconds of GPU time per call, by projection and kernel name, from eager calls."""
    from torch.profiler import ProfilerActivity, profile

    times: dict[str, float] = {}
    for pt in points:
        for info in pt.infos:  # launch plans made again under the current settings
            info.host_derived.clear()
        buf = pt.out.clone()
        for k in range(len(pt.infos)):
            pt.call(backend, buf, k)  # compiles and caches outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(calls):
                pt.call(backend, buf, i % len(pt.infos))
            torch.cuda.synchronize()
        per_kernel: dict[str, float] = defaultdict(float)
        for evt in prof.events():
            if evt.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[evt.name] += evt.device_time / calls
        for name, us in per_kernel.items():
            times[f"{pt.meta['proj']}:{name}"] = us
    return times


def _chosen_points(args: argparse.Namespace) -> list[tuple[str, int, int, str | None]]:
    if not args.point:
        return SMOKE_CASES if args.smoke else CASES
    points = []
    for spec in args.point:
        case, b, n, *rest = spec.split(":")
        if case not in {c for c, *_ in CASES} or rest not in ([], ["runs"]):
            raise SystemExit(f"--point {spec!r}: expected CASE:B:ADAPTERS[:runs] with CASE one of the cases")
        points.append((case, int(b), int(n), "runs" if rest else None))
    return points


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument(
        "--rank",
        type=int,
        nargs="+",
        default=[16],
        help="a rank, or a mix: adapter s has rank[s % len(rank)]",
    )
    p.add_argument("--pool-rank", type=int, default=None, help="the pool's rank (default the largest --rank)")
    p.add_argument(
        "--heavy-first",
        action="store_true",
        help="decode rows ordered by rank, largest first (then by slot), instead of by slot alone",
    )
    p.add_argument("--page-rank", type=int, default=None, help="page the pools by this many ranks")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--mode", nargs="*", default=[], help="extra modes NAME:knob=json,... of the case backend's TUNING"
    )
    p.add_argument(
        "--profile-mode",
        nargs="*",
        default=["default"],
        help="the modes whose kernels are profiled (the first one's times are the row's kernels_us, all of "
        "them its kernels_us_by_mode)",
    )
    p.add_argument(
        "--backend",
        default=None,
        choices=("triton-sgmv", "triton-bgmv", "triton-fused"),
        help="time every case with this backend (default: SGMV for runs, mixed and prefill, BGMV for rows); "
        "triton-fused routes decode batches one row a segment, as its graphs capture them",
    )
    p.add_argument("--cases", nargs="*", default=None, help="only these case names")
    p.add_argument(
        "--point",
        nargs="*",
        default=None,
        metavar="CASE:B:ADAPTERS[:runs]",
        help="time these points instead of the built-in ones, e.g. decode-runs:72:24:runs (a serving run's "
        "mean decode batch on 32 adapters: 73 rows, 23 distinct adapters a step)",
    )
    args = p.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    bw = None if args.smoke else copy_bandwidth(device)
    results = []
    for case, B, n, segments in _chosen_points(args):
        if args.cases and case not in args.cases:
            continue
        default = (
            "triton-sgmv" if case in ("decode-runs", "mixed", "mixed-sorted", "prefill") else "triton-bgmv"
        )
        name = args.backend or default
        backend = get_backend(name)
        points = sweep._points(
            case,
            B,
            n,
            tuple(args.rank),
            args.smoke,
            device,
            pool_rank=args.pool_rank,
            heavy_first=args.heavy_first,
        )
        if args.page_rank:
            for pt in points:
                pt.weights = page_weights(pt.weights, args.page_rank)
        entries = _tight_runs(points, points[0].infos[0].rank_bound) if segments == "runs" else None
        if name == "triton-fused" and case.startswith("decode"):
            _one_row_a_segment(points)
            entries = B
        tuning = {
            "triton-sgmv": triton_sgmv,
            "triton-bgmv": triton_bgmv,
            "triton-fused": triton_fused_decode,
        }[name].TUNING
        modes = {"default": {}}
        for extra in args.mode:
            label, _, settings = extra.partition(":")
            overrides = {k: json.loads(v) for k, v in (kv.split("=") for kv in settings.split(","))}
            if set(overrides) <= set(tuning):
                modes[label] = overrides
        row = {"case": case, "B": B, "adapters": n, "segments": entries or max(1, B // 2), "backend": name}
        for mode, overrides in modes.items():
            row[mode] = [
                sweep._time_with(backend, tuning, overrides, points, device) for _ in range(args.rounds)
            ]
        row["bytes"] = sum(pt.bytes for pt in points)
        if bw is not None:
            row["floor_s"] = row["bytes"] / bw
            row["kernels_us_by_mode"] = {}
            for mode in args.profile_mode:
                saved = dict(tuning)
                tuning.update(modes.get(mode, {}))
                try:
                    row["kernels_us_by_mode"][mode] = _kernel_times(backend, points)
                finally:
                    tuning.clear()
                    tuning.update(saved)
            row["kernels_us"] = row["kernels_us_by_mode"][args.profile_mode[0]]
        results.append(row)
        us = {m: [round(s * 1e6, 1) for s in row[m] if s is not None] for m in modes}
        floor = f", floor {row['floor_s'] * 1e6:.1f} us" if bw else ""
        print(f"== {case} B={B} adapters={n} segments={row['segments']} ({name}): {us}{floor}", flush=True)
        by_mode = row.get("kernels_us_by_mode", {})
        if by_mode:
            print(f"   {'kernel (us), by profiled mode':60s} " + " ".join(f"{m[:12]:>12s}" for m in by_mode))
            for k in sorted(set().union(*by_mode.values())):  # a mode may launch kernels the others do not
                print(
                    f"   {k[:60]:60s} "
                    + " ".join(f"{t.get(k, float('nan')):12.1f}" for t in by_mode.values())
                )
        sweep._release(points, device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "rank": args.rank,
                    "pool_rank": args.pool_rank or max(args.rank),
                    "heavy_first": args.heavy_first,
                    "copy_bandwidth": bw,
                    "results": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
