"""Launch-heuristic sweep of the Triton LoRA backends (issues 13 and 23): one knob of a backend's
``TUNING`` at a time around its defaults, timed on the batches serving launches.

Cases (Mistral-7B projections qkv, o, gate_up, down; bf16; rank 16 unless ``--rank``):
- ``decode-runs``: a CUDA-graph decode step in the runs layout, B rows sorted by slot over N adapters,
  filled with ``LoRABatchInfo.fill_rows(..., "runs", segments=B // 2)`` as triton-auto captures it
  (SGMV);
- ``decode-rows``: the same rows one segment each (``fill_rows(..., "rows")``, BGMV), and B rows on B
  distinct adapters;
- ``prefill``: 4096 tokens in requests of 512 over 8 adapters (``fill``), the eager prefill/mixed steps.

Each time is the sum over the four projections of ``backend.add_lora`` (shrink + expand), replayed in a
CUDA graph over rotated adapter copies so weights stream from HBM (``mmlora.bench.kernels``). Printed:
per case, microseconds and GB/s of adapter + activation bytes for each knob value, and the best value per
knob. ``--smoke`` runs tiny shapes under ``TRITON_INTERPRET=1`` on CPU to check the script.

    PYTHONPATH=. python benchmarks/scripts/lora_tuning_sweep.py --out sweep.json
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from mmlora.backends import get_backend, triton_bgmv, triton_sgmv
from mmlora.bench import kernels as kb
from mmlora.forward.lora import LoRABatchInfo, rank_bucket

SWEEPS = {
    "triton-sgmv": (
        triton_sgmv.TUNING,
        {
            "waves": [1, 2, 4, 8, 16],
            "max_split_k": [4, 8, 16, 32],
            "shrink_block_m": [16, 32, 64, 128],
            "block_m": [16, 32, 64],
            "shrink_warps": [1, 2, 4, 8],
            "block_n": [64, 128, 256, 512],
            "expand_warps": [1, 2, 4, 8],
            "run_expand_warps": [1, 2, 4],
        },
    ),
    "triton-bgmv": (
        triton_bgmv.TUNING,
        {
            "waves": [1, 2, 4, 8, 16],
            "max_split_k": [4, 8, 16, 32],
            "shrink_warps": [1, 2, 4, 8],
            "expand_tile": [1024, 2048, 4096, 8192],
            "expand_warps": [1, 2, 4, 8],
        },
    ),
}


#: ``--grid``: every combination of these values (the rest at their defaults), per backend, on its cases.
GRIDS = {
    "triton-bgmv": {
        "expand_warps": [1, 2],
        "max_split_k": [4, 16, 32],
        "shrink_warps": [2, 4],
        "expand_tile": [4096, 8192],
    },
    "sgmv-shrink": {"waves": [1, 2, 4], "shrink_block_m": [16, 32, 64], "max_split_k": [4, 16]},
    "sgmv-expand": {"block_m": [32, 64], "block_n": [256, 512], "expand_warps": [2, 4, 8]},
}
GRID_CASES = {
    "triton-bgmv": [
        ("decode-rows", 8, 8),
        ("decode-rows", 32, 32),
        ("decode-rows", 64, 64),
        ("decode-rows", 128, 128),
    ],
    "sgmv-shrink": [
        ("prefill", 0, 8),
        ("mixed", 128, 32),
        ("decode-runs", 128, 32),
        ("decode-runs", 256, 32),
    ],
    "sgmv-expand": [
        ("prefill", 0, 8),
        ("mixed", 128, 32),
        ("decode-runs", 128, 32),
        ("decode-runs", 256, 32),
    ],
}


def _points(
    case: str,
    B: int,
    n_adapters: int,
    rank: int,
    smoke: bool,
    device: torch.device,
    segments: int | None = None,
    pool_rank: int | None = None,
    heavy_first: bool = False,
) -> list:
    """The four projections' benchmark points of a case; ``rank``: one rank, or a mix (distinct adapter s
    has rank ``mix[s % len(mix)]``); ``segments``: the runs layout's segment entries (default B // 2, as
    triton-auto captures it); ``pool_rank``: the pool's rank (default the largest rank); ``heavy_first``:
    a decode batch's rows ordered by rank, largest first, then by slot (instead of by slot alone), so the
    programs of the highest-rank segments come first in the grid."""
    mix = (rank,) if isinstance(rank, int) else tuple(rank)
    R = pool_rank or max(mix)
    projections = kb.SMOKE_PROJECTIONS if smoke else kb.PROJECTIONS
    dtype = torch.float32 if smoke else torch.bfloat16
    points = []
    for proj, (in_f, widths) in projections.items():
        if case == "prefill":
            phase, T, pop, req_len = "prefill", (24 if smoke else 4096), "uniform", (8 if smoke else 512)
            kb.UNIFORM_POOL = 8
        elif case.startswith(
            "mixed"
        ):  # a serving mixed step: B decode rows on N adapters, a 2048-token chunk
            phase, T, pop, req_len = "decode", B, "uniform", 512
            kb.UNIFORM_POOL = n_adapters
        else:
            phase, T, pop, req_len = "decode", B, ("distinct" if n_adapters >= B else "grouped"), 512
            kb.UNIFORM_POOL = n_adapters
        pt = kb._Point(proj, in_f, widths, mix, pool_rank, phase, T, pop, dtype, device, req_len, 0)
        if case.startswith("decode"):
            lens, slots = kb._layout(phase, T, pop, req_len, random.Random(0))
            n_distinct = max(slots) + 1
            infos = []
            for k in range(len(pt.infos)):
                info = LoRABatchInfo(T, pt.A.shape[0], device, max_lora_rank=R)
                info.ranks.copy_(pt.infos[k].ranks)
                info.ranks_host = list(pt.infos[k].ranks_host)
                rows = sorted(k * n_distinct + s for s in slots)
                if heavy_first:
                    rows.sort(key=lambda row: -info.ranks_host[row])  # stable: by slot within a rank
                if case == "decode-runs":
                    info.fill_rows(rows, rank_bucket(max(mix), R), "runs", segments=max(1, T // 2))
                else:
                    info.fill_rows(rows, rank_bucket(max(mix), R), "rows")
                infos.append(info)
            pt.infos = infos
        if case.startswith("mixed"):
            chunk = 16 if smoke else 2048
            lens, slots = kb._layout("decode", B, "uniform", 512, random.Random(0))
            if case == "mixed-sorted":  # decode rows side by side per adapter: fill merges them into runs
                slots = sorted(slots)
            g = torch.Generator(device=device).manual_seed(1)
            pt.x = torch.randn(B + chunk, in_f, generator=g, device=device).to(dtype)
            pt.out = torch.randn(B + chunk, sum(widths), generator=g, device=device).to(dtype)
            es = torch.finfo(dtype).bits // 8
            pt.bytes += chunk * (in_f + 2 * sum(widths)) * es
            n_distinct = max(slots) + 1
            for k, info in enumerate(pt.infos):
                fresh = LoRABatchInfo(B + chunk, pt.A.shape[0], device, max_lora_rank=R)
                fresh.ranks.copy_(info.ranks)
                fresh.ranks_host = list(info.ranks_host)
                fresh.fill(lens + [chunk], [k * n_distinct + s for s in slots] + [k * n_distinct])
                pt.infos[k] = fresh
        points.append(pt)
    return points


def _time(backend, points: list, device: torch.device) -> tuple[float, int]:  # noqa: ANN001
    total_s, total_bytes = 0.0, 0
    for pt in points:
        buf = pt.out.clone()
        calls = [lambda k=k, buf=buf, pt=pt: pt.call(backend, buf, k) for k in range(len(pt.infos))]
        secs, _ = kb._time_calls(calls, device)
        total_s += secs
        total_bytes += pt.bytes
    return total_s, total_bytes


def _time_with(backend, tuning: dict, overrides: dict, points: list, device: torch.device) -> float | None:  # noqa: ANN001
    """Seconds of the points with ``overrides`` on top of ``tuning``'s current values (restored after);
    None when a kernel cannot run them (said on the console)."""
    default = dict(tuning)
    tuning.update(overrides)
    for pt in points:  # launch plans are kept per batch info: made again under these settings
        for info in pt.infos:
            info.host_derived.clear()
    try:
        return _time(backend, points, device)[0]
    except Exception as exc:  # a value a kernel cannot compile: say so, go on
        print(f"   {overrides}: failed: {type(exc).__name__}: {exc}"[:300], flush=True)
        return None
    finally:
        tuning.clear()
        tuning.update(default)


def _release(points: list, device: torch.device) -> None:
    """Free a case's adapter copies before the next case allocates its own."""
    points.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _write(args: argparse.Namespace, key: str, results: list) -> None:
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rank": args.rank, key: results}, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--out", default=None)
    p.add_argument("--grid", action="store_true", help="every combination of GRIDS, per case")
    args = p.parse_args()
    if args.grid:
        return grid(args)
    device = torch.device("cpu" if args.smoke else "cuda")
    cases = (
        [("decode-runs", 8, 2), ("decode-rows", 8, 2), ("prefill", 0, 8)]
        if args.smoke
        else [
            ("decode-runs", 128, 32),
            ("decode-runs", 256, 32),
            ("decode-rows", 32, 32),
            ("decode-rows", 128, 128),
            ("prefill", 0, 8),
        ]
    )
    results = []
    for case, B, n in cases:
        backend_name = "triton-sgmv" if case in ("decode-runs", "prefill") else "triton-bgmv"
        tuning, knobs = SWEEPS[backend_name]
        backend = get_backend(backend_name)
        points = _points(case, B, n, args.rank, args.smoke, device)
        default = dict(tuning)
        base_s, nbytes = _time(backend, points, device)
        label = f"{case} B={B} adapters={n} ({backend_name})"
        print(
            f"== {label}: default {base_s * 1e6:.1f} us, {nbytes / base_s / 1e9:.0f} GB/s {default}",
            flush=True,
        )
        for knob, values in knobs.items():
            row = []
            for v in values[:2] if args.smoke else values:
                secs = _time_with(backend, tuning, {knob: v}, points, device)
                if secs is None:
                    continue
                row.append((v, secs))
                results.append({"case": label, "knob": knob, "value": v, "us": secs * 1e6,
                                "GBps": nbytes / secs / 1e9, "default_us": base_s * 1e6})  # fmt: skip
            if row:
                best = min(row, key=lambda t: t[1])
                cells = ", ".join(f"{v}: {s * 1e6:.1f}" for v, s in row)
                print(
                    f"   {knob:13s} {cells}  -> best {best[0]} ({best[1] / base_s:.3f}x default)", flush=True
                )
        _release(points, device)
    _write(args, "results", results)


def grid(args: argparse.Namespace) -> None:
    import itertools

    device = torch.device("cpu" if args.smoke else "cuda")
    results = []
    for name, knobs in GRIDS.items():
        backend_name = "triton-bgmv" if name == "triton-bgmv" else "triton-sgmv"
        tuning = SWEEPS[backend_name][0]
        backend = get_backend(backend_name)
        cases = GRID_CASES[name][:1] if args.smoke else GRID_CASES[name]
        combos = list(itertools.product(*knobs.values()))
        for case, B, n in cases:
            points = _points(
                case, B if not args.smoke else 8, n if not args.smoke else 2, args.rank, args.smoke, device
            )
            label = f"{name} {case} B={B} adapters={n}"
            base_s, nbytes = _time(backend, points, device)
            rows = []
            for combo in combos[:2] if args.smoke else combos:
                secs = _time_with(backend, tuning, dict(zip(knobs, combo)), points, device)
                if secs is None:
                    continue
                rows.append((secs, dict(zip(knobs, combo))))
                results.append({"grid": name, "case": label, "tuning": dict(zip(knobs, combo)),
                                "us": secs * 1e6, "default_us": base_s * 1e6, "GBps": nbytes / secs / 1e9})  # fmt: skip
            rows.sort(key=lambda r: r[0])
            print(f"== {label}: default {base_s * 1e6:.1f} us ({nbytes / base_s / 1e9:.0f} GB/s)", flush=True)
            for secs, combo in rows[:5]:
                print(
                    f"   {secs * 1e6:7.1f} us ({secs / base_s:.3f}x, {nbytes / secs / 1e9:.0f} GB/s) {combo}",
                    flush=True,
                )
            _release(points, device)
    _write(args, "grid", results)


if __name__ == "__main__":
    main()
