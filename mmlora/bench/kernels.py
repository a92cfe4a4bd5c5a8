"""Kernel microbenchmark: LoRA shrink + expand per Mistral-7B projection, for every LoRA backend.

For each projection (qkv packed as 3 slices, o, gate_up packed as 2, down), rank mix, token count (decode:
one token per request; prefill: requests of 512 tokens) and adapter popularity (distinct, uniform over
16 adapters, the same sorted by adapter as decode graphs order rows, identical) it times
``backend.add_lora`` (shrink + expand) and the base projection's own GEMM, and reports achieved
bandwidth: bytes of the distinct adapters' weights plus x read and out read + written, over the time,
against a device-to-device copy measured in the same run. A rank mix (``--ranks 8 16 64 8,64``) cycles
its ranks over the distinct adapters, in a pool of rank ``--pool-rank`` (default: the mix's largest):
bytes count each adapter's own rank, so a mix that costs the mean of its parts reaches the same
bandwidth.

On CUDA each timing replays a CUDA graph of several calls that rotate over up to 16 disjoint copies
of the adapters (aiming at >= 256 MB touched per replay), so weights stream from HBM as they would in
a model step rather than from L2; a time is the median of 5 samples of >= 2 ms of replays. Writes
``kernels.json`` (and ``kernels.png`` when matplotlib is installed) under ``--out``. Without CUDA
only ``--smoke`` runs (with ``TRITON_INTERPRET=1``): tiny shapes, to check the CLI end to end.

    python -m mmlora.bench kernels --out benchmarks/results/kernels [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mmlora.bench.cli import make_parser, progress
from mmlora.bench.kernels_report import BACKENDS, plot, summary, table

logger = logging.getLogger(__name__)

PROJECTIONS = {  # name -> (in_features, slice widths)
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
SMOKE_PROJECTIONS = {"qkv": (64, (64, 16, 16)), "down": (96, (32,))}
#: grouped: uniform, with the rows sorted by adapter, as the CUDA-graph runner orders decode rows (the
#: fused decode kernel reads an adapter once per run of rows, so it is timed on both orders).
POPULARITY = ("distinct", "uniform", "grouped", "identical")
UNIFORM_POOL = 16
ROTATE_BYTES = 256 << 20
MAX_ROTATIONS = 16


def _layout(
    phase: str, T: int, popularity: str, req_len: int, rng: random.Random
) -> tuple[list[int], list[int]]:
    """Per-request token counts and compact slot ids (0..n_distinct-1) for one batch."""
    lens = (
        [1] * T if phase == "decode" else [req_len] * (T // req_len) + ([T % req_len] if T % req_len else [])
    )
    if popularity == "distinct":
        slots = list(range(len(lens)))
    elif popularity == "uniform":
        slots = [rng.randrange(UNIFORM_POOL) for _ in lens]
    elif popularity == "grouped":
        slots = sorted(rng.randrange(UNIFORM_POOL) for _ in lens)
    else:
        slots = [0] * len(lens)
    remap = {s: i for i, s in enumerate(dict.fromkeys(slots))}
    return lens, [remap[s] for s in slots]


def _rank_mix(text: str) -> tuple[int, ...]:
    try:
        mix = tuple(int(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a rank mix is comma-separated integers, got {text!r}") from None
    if min(mix) < 1:
        raise argparse.ArgumentTypeError(f"ranks must be >= 1, got {text!r}")
    return mix


def _mix_label(mix: tuple[int, ...]) -> str:
    return ",".join(map(str, mix))


def _time_calls(fns: list[Callable[[], object]], device: torch.device) -> tuple[float, bool]:
    """Median seconds per call of ``fns`` (run in sequence), through a CUDA graph where possible."""
    if device.type != "cuda":
        for f in fns:
            f()
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            for f in fns:
                f()
            runs.append((time.perf_counter() - t0) / len(fns))
        return statistics.median(runs), False
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (and Triton compiles) outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        run: Callable[[], object] = graph.replay
        used_graph = True
    except RuntimeError as exc:  # a backend that cannot be captured is timed eagerly, and marked
        logger.warning("graph capture failed (%s); timing eagerly", exc)
        torch.cuda.synchronize()
        run, used_graph = (lambda: [f() for f in fns]), False
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    reps = max(1, min(200, math.ceil(2.0 / max(start.elapsed_time(end), 1e-3))))
    samples = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            run()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / reps / len(fns))
    return statistics.median(samples), used_graph


def _copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written.

    Timed eagerly with events over a 2 GiB copy (launch cost is negligible at that size); a memcpy
    node inside a CUDA graph may run on the copy engines, which are slower than the SMs.
    """
    n = (2 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    if device.type != "cuda":
        t0 = time.perf_counter()
        dst.copy_(src)
        return 2 * n / (time.perf_counter() - t0) / 1e9
    t_end = time.perf_counter() + 0.5  # let the clocks ramp up from idle first
    while time.perf_counter() < t_end:
        dst.copy_(src)
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return 2 * n / statistics.median(samples) / 1e9


class _Point:
    """One benchmark configuration with its pool (rotated copies), batch infos, x and out."""

    def __init__(self, proj: str, in_f: int, widths: tuple[int, ...], mix: tuple[int, ...], pool_rank: int | None,
                 phase: str, T: int, popularity: str, dtype: torch.dtype, device: torch.device, req_len: int,
                 seed: int) -> None:  # fmt: skip
        from mmlora.forward.lora import LoRABatchInfo, LoRAWeights

        R = pool_rank or max(mix)
        self.meta = dict(proj=proj, in_features=in_f, out_features=sum(widths), n_slices=len(widths),
                         rank=_mix_label(mix), pool_rank=R, phase=phase, tokens=T, popularity=popularity)  # fmt: skip
        rng = random.Random(seed)
        lens, slots = _layout(phase, T, popularity, req_len, rng)
        n_distinct = max(slots) + 1
        n, out_f, es = len(widths), sum(widths), torch.finfo(dtype).bits // 8
        ranks = [mix[s % len(mix)] for s in range(n_distinct)]  # distinct adapter s has rank ranks[s]
        per_call = sum(n * r * in_f + out_f * r for r in ranks) * es
        n_rot = 1 if device.type != "cuda" else max(1, min(MAX_ROTATIONS, math.ceil(ROTATE_BYTES / per_call)))
        S = n_rot * n_distinct
        g = torch.Generator(device=device).manual_seed(seed)
        self.A = (torch.randn(S, n * R, in_f, generator=g, device=device) / in_f**0.5).to(dtype)
        self.B = (torch.randn(S, out_f, R, generator=g, device=device) / R**0.5).to(dtype)
        # Zero past each slot's rank, as the pool keeps its padding.
        slot_ranks = torch.tensor(ranks * n_rot, device=device)
        live = torch.arange(R, device=device)[None, :] < slot_ranks[:, None]  # [S, R]
        self.A *= live.repeat(1, n)[:, :, None].to(dtype)
        self.B *= live[:, None, :].to(dtype)
        self.scalings = torch.full((S, n), 2.0, device=device)
        offsets = tuple([0] + [sum(widths[: i + 1]) for i in range(n)])
        self.weights = LoRAWeights(self.A, self.B, self.scalings, offsets)
        self.infos = []
        for k in range(n_rot):
            info = LoRABatchInfo(T, S, device, max_lora_rank=R)
            info.ranks.copy_(slot_ranks)  # one copy, not S launches
            info.ranks_host = ranks * n_rot
            info.fill(lens, [k * n_distinct + s for s in slots])
            self.infos.append(info)
        self.x = torch.randn(T, in_f, generator=g, device=device).to(dtype)
        self.out = torch.randn(T, out_f, generator=g, device=device).to(dtype)
        self.bytes = per_call + T * in_f * es + 2 * T * out_f * es
        self.meta.update(n_adapters=n_distinct, rotations=n_rot, bytes=self.bytes)

    def call(self, backend: object, out: torch.Tensor, k: int) -> None:
        backend.add_lora(out, self.x, self.weights, self.infos[k])


def _gemm_time(in_f: int, out_f: int, T: int, dtype: torch.dtype, device: torch.device) -> float:
    n_w = 1 if device.type != "cuda" else max(1, min(4, math.ceil(ROTATE_BYTES / (in_f * out_f * 2))))
    ws = [torch.randn(out_f, in_f, device=device).to(dtype) for _ in range(n_w)]
    x = torch.randn(T, in_f, device=device).to(dtype)
    secs, _ = _time_calls([lambda w=w: torch.nn.functional.linear(x, w) for w in ws], device)
    return secs


def run(args: argparse.Namespace, device: torch.device) -> dict:
    from mmlora.backends import get_backend

    smoke = args.smoke
    dtype = torch.float32 if device.type != "cuda" else getattr(torch, args.dtype)
    projections = SMOKE_PROJECTIONS if smoke else {p: PROJECTIONS[p] for p in args.projections}
    mixes = ((8,), (4, 8)) if smoke else tuple(args.ranks)
    if smoke:
        decode_t, prefill_t, req_len, pops = (1, 5), (24,), 8, ("distinct", "grouped", "identical")
    elif args.quick:
        decode_t, prefill_t, req_len, pops = (1, 32, 256), (512, 4096), 512, POPULARITY
    else:
        decode_t, prefill_t, req_len, pops = (
            (1, 8, 32, 64, 128, 256),
            (512, 1024, 2048, 4096, 8192),
            512,
            POPULARITY,
        )
    backends = {name: get_backend(name) for name in args.backends}
    copy_gbps = _copy_bandwidth(device)
    logger.info("device-to-device copy: %.0f GB/s", copy_gbps)
    results, gemm_cache = [], {}
    for proj, (in_f, widths) in progress(projections.items(), "projections", total=len(projections)):
        for phase, points in (("decode", decode_t), ("prefill", prefill_t)):
            for T in points:
                key = (proj, T)
                if key not in gemm_cache:
                    gemm_cache[key] = _gemm_time(in_f, sum(widths), T, dtype, device)
                for mix in mixes:
                    for pop in pops:
                        pt = _Point(
                            proj, in_f, widths, mix, args.pool_rank, phase, T, pop, dtype, device, req_len,
                            args.seed,
                        )  # fmt: skip
                        results.extend(_bench_point(pt, backends, gemm_cache[key], copy_gbps, device))
                        del pt
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                logger.info("done %s %s T=%d", proj, phase, T)
    return {
        "meta": {
            "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m mmlora.bench kernels " + " ".join(args.argv),
            "device": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else "cpu (Triton interpreter)",
            "torch": torch.__version__,
            "triton": _triton_version(),
            "dtype": str(dtype).removeprefix("torch."),
            "copy_GBps": copy_gbps,
            "prefill_request_tokens": req_len,
            "uniform_pool": UNIFORM_POOL,
        },
        "results": results,
        "summary": summary(results),
    }


def _bench_point(
    pt: _Point, backends: dict, gemm_s: float, copy_gbps: float, device: torch.device
) -> list[dict]:
    out0 = pt.out.clone()
    ref = None
    rows = []
    for name, be in backends.items():
        check = out0.clone()
        pt.call(be, check, 0)
        delta = (check.double() - out0.double()).norm().item()
        if ref is None:
            ref = check
            rel_err = 0.0
        else:
            rel_err = (check.double() - ref.double()).norm().item() / max(delta, 1e-30)
        buf = out0.clone()
        calls = [lambda k=k, be=be, buf=buf: pt.call(be, buf, k) for k in range(len(pt.infos))]
        secs, graph = _time_calls(calls, device)
        gbps = pt.bytes / secs / 1e9
        rows.append({**pt.meta, "backend": name, "time_us": secs * 1e6, "GBps": gbps,
                     "bw_frac": gbps / copy_gbps, "gemm_us": gemm_s * 1e6, "lora_over_gemm": secs / gemm_s,
                     "rel_err_vs_first": rel_err, "graph": graph})  # fmt: skip
    return rows


def _triton_version() -> str:
    import triton

    return triton.__version__


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = make_parser("python -m mmlora.bench kernels", __doc__)
    p.add_argument(
        "--out", type=Path, default=Path("artifacts/bench-kernels"), help="folder for JSON and PNG"
    )
    p.add_argument("--quick", action="store_true", help="fewer token counts (one H200 run in a few minutes)")
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes; the only mode without CUDA (interpreter)"
    )
    p.add_argument("--backends", nargs="+", default=list(BACKENDS))
    p.add_argument("--projections", nargs="+", default=list(PROJECTIONS), choices=list(PROJECTIONS))
    p.add_argument(
        "--ranks",
        nargs="+",
        type=_rank_mix,
        default=[(8,), (16,), (64,)],
        help="ranks or comma-separated rank mixes, e.g. 8 16 64 8,64 (a mix cycles over the adapters)",
    )
    p.add_argument(
        "--pool-rank", type=int, default=None, help="slot rank of the pool (default: each mix's max)"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.smoke and os.environ.get("TRITON_INTERPRET") == "1":
        device = torch.device("cpu")
    else:
        raise SystemExit(
            "mmlora.bench kernels needs a CUDA device; for a tiny CPU check run "
            "`TRITON_INTERPRET=1 python -m mmlora.bench kernels --smoke --out DIR`"
        )
    data = run(args, device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps(data, indent=1))
    plotted = plot(data, args.out / "kernels.png")
    sys.stdout.write(
        table(data) + f"\nwrote {args.out / 'kernels.json'}" + (" and kernels.png\n" if plotted else "\n")
    )
    return data


if __name__ == "__main__":
    main()
