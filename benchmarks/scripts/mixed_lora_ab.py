"""A/B of SGMV's hybrid path (issue 13 item 2): long segments through dense cuBLAS GEMMs, the rest through
SGMV, at several thresholds (``triton_sgmv.TUNING["dense_min_seg"]``; 0 is the SGMV-only path).

Serving shapes of one Mistral-7B layer (hidden 4096, q 4096, kv 1024 each, intermediate 14336; bf16), a
pool of 32 slots of rank 16, the four LoRA modules of a layer (qkv packed, o, gate_up packed, down)
through ``triton-auto`` (the default backend). Batches:

  a  128 decode rows on 32 adapters (unsorted, as eager steps route them) + one 2048-token chunk
  b  128 decode rows + two 1024-token chunks on 2 adapters
  c  a 4096-token prefill over 8 adapters (8 x 512)
  d  32 decode rows on 32 adapters (BGMV under triton-auto: must not regress)
  e  127 decode rows + one 260-token prompt (the typical mixed step of the standard serving workload)
  a-sorted, e-sorted  a and e with the decode rows ordered by slot (runs of 4): what grouping decode rows
     by adapter would gain (the eager path does not do that)

Every variant's output is first checked against the pure-torch reference backend (torch-gather) within
bf16 tolerance. Then per variant: GPU time per layer (CUDA events around the four ``add_lora`` calls,
median of ``--repeats`` after a warm-up, the pool rotated over 4 layer copies so adapter weights are not
all L2-resident), host time of those four calls (no sync inside), the bytes the layer must move (each
LoRA row's output read and written once, x read once, each distinct adapter's A and B read once) over
the GPU time, and the base GEMMs of the same shapes (``F.linear``) for the LoRA/base ratio.

    PYTHONPATH=$PWD python benchmarks/scripts/mixed_lora_ab.py --out ab.json

About 1 minute on an H200. ``--small`` runs tiny shapes (a CPU check of the script, TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from mmlora.backends import get_backend, triton_sgmv  # noqa: E402
from mmlora.backends.dense_segments import long_segments  # noqa: E402
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--out", required=True, help="JSON results path")
p.add_argument("--repeats", type=int, default=50)
p.add_argument("--warmup", type=int, default=5)
p.add_argument("--thresholds", type=int, nargs="+", default=[0, 128, 256, 512, 1024, 2048])
p.add_argument("--copies", type=int, default=4, help="layer copies the pool rotates over")
p.add_argument("--small", action="store_true", help="tiny shapes (CPU check of the script)")
args = p.parse_args()

cuda = torch.cuda.is_available()
dev = torch.device("cuda" if cuda else "cpu")
dtype = torch.bfloat16 if cuda else torch.float32
if args.small:
    H, Q, KV, INTER, SLOTS, R, SCALE = 64, 64, 16, 96, 32, 16, 64  # token counts divided by SCALE
    args.repeats, args.warmup, args.copies = min(args.repeats, 2), 1, 1
else:
    H, Q, KV, INTER, SLOTS, R, SCALE = 4096, 4096, 1024, 14336, 32, 16, 1
# name: (in_features, slice widths)
MODULES = {"qkv": (H, (Q, KV, KV)), "o": (Q, (H,)), "gate_up": (H, (INTER, INTER)), "down": (INTER, (H,))}


def seg(n: int) -> int:
    return max(1, n // SCALE)


def decode_rows(n: int, adapters: int, first: int = 0) -> list[tuple[int, int]]:
    return [(1, first + i % adapters) for i in range(n)]


CASES: dict[str, list[tuple[int, int]]] = {  # (tokens, slot) per request, in batch order
    "a": decode_rows(128, 32) + [(seg(2048), 5)],
    "b": decode_rows(128, 32) + [(seg(1024), 3), (seg(1024), 9)],
    "c": [(seg(512), s) for s in range(8)],
    "d": decode_rows(32, 32),
    "e": decode_rows(127, 32) + [(seg(260), 7)],
}
CASES["a-sorted"] = sorted(CASES["a"][:-1], key=lambda r: r[1]) + CASES["a"][-1:]
CASES["e-sorted"] = sorted(CASES["e"][:-1], key=lambda r: r[1]) + CASES["e"][-1:]
MAX_TOKENS = max(sum(n for n, _ in reqs) for reqs in CASES.values())


def make_layer(g: torch.Generator) -> dict[str, LoRAWeights]:
    layer = {}
    for name, (in_f, widths) in MODULES.items():
        n = len(widths)
        offs = tuple([0] + [sum(widths[: i + 1]) for i in range(n)])
        A = (torch.randn(SLOTS, n * R, in_f, generator=g, device=dev) / in_f**0.5).to(dtype)
        B = (torch.randn(SLOTS, offs[-1], R, generator=g, device=dev) / R**0.5).to(dtype)
        layer[name] = LoRAWeights(A, B, torch.full((SLOTS, n), 2.0, device=dev), offs)
    return layer


g = torch.Generator(device=dev).manual_seed(0)
layers = [make_layer(g) for _ in range(args.copies)]
base_w = {
    name: (torch.randn(sum(w), in_f, generator=g, device=dev) / in_f**0.5).to(dtype)
    for name, (in_f, w) in MODULES.items()
}
auto = get_backend("triton-auto", dev)
ref = get_backend("torch-gather", dev)


def sync() -> None:
    if cuda:
        torch.cuda.synchronize()


def timed(fn, n: int) -> tuple[float, float]:  # noqa: ANN001
    """(median GPU us, median host us) of ``fn(i)`` over n calls after the warm-up."""
    for i in range(args.warmup):
        fn(i)
    sync()
    gpu, host = [], []
    for i in range(n):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn(i)
        host.append((time.perf_counter() - t0) * 1e6)
        if cuda:
            end.record()
            gpu.append((start, end))
    sync()
    gpu_us = [s.elapsed_time(e) * 1e3 for s, e in gpu] if cuda else host
    return statistics.median(gpu_us), statistics.median(host)


def lora_bytes(info: LoRABatchInfo) -> int:
    """What one layer's LoRA must move at least: LoRA rows' out read + written, x read, distinct adapters."""
    rows = sum(n for n, s in zip(info.seg_lens_host, info.seg_slots_host) if s >= 0)
    slots = {s for s in info.seg_slots_host if s >= 0}
    esz = torch.finfo(dtype).bits // 8
    total = 0
    for in_f, widths in MODULES.values():
        out_f, n = sum(widths), len(widths)
        total += rows * (2 * out_f + in_f) * esz + len(slots) * (n * R * in_f + out_f * R) * esz
    return total


results: dict = {
    "device": torch.cuda.get_device_name() if cuda else "cpu",
    "torch": torch.__version__,
    "dtype": str(dtype),
    "shapes": {k: [v[0], list(v[1])] for k, v in MODULES.items()},
    "slots": SLOTS,
    "rank": R,
    "repeats": args.repeats,
    "cases": {},
}
default_thr = triton_sgmv.TUNING["dense_min_seg"]


def run_case(case: str, reqs: list[tuple[int, int]]) -> dict:
    """One batch: its shape, the base GEMMs' time, and every variant's check and timings."""
    lens, slots = [n for n, _ in reqs], [s for _, s in reqs]
    T = sum(lens)
    info = LoRABatchInfo(MAX_TOKENS, SLOTS, dev, R)
    for s in range(SLOTS):
        info.set_slot_rank(s, R)
    info.fill(lens, slots)
    xs = {
        name: torch.randn(T, in_f, generator=g, device=dev).to(dtype) for name, (in_f, _) in MODULES.items()
    }
    outs = {
        name: torch.randn(T, sum(w), generator=g, device=dev).to(dtype) for name, (_, w) in MODULES.items()
    }
    need = lora_bytes(info)
    row = {
        "tokens": T,
        "segments": info.num_segments,
        "max_seg_len": info.max_seg_len,
        "picked": auto.pick(info).name,
        "lora_bytes_per_layer": need,
    }

    def base_layer(i: int) -> None:
        for name in MODULES:
            F.linear(xs[name], base_w[name])

    row["base_us"], _ = timed(base_layer, args.repeats)

    # Correctness first: every variant against the reference (one layer copy).
    want = {}
    for name, w in layers[0].items():
        o = outs[name].clone()
        ref.add_lora(o, xs[name], w, info)
        want[name] = o.float()
    variants: dict[str, tuple[int, tuple[int, ...]]] = {}  # label -> (threshold, lengths sent to cuBLAS)
    for label_thr in args.thresholds:
        thr = max(1, label_thr // SCALE) if label_thr else 0
        long = long_segments(info, thr) if auto.pick(info).name == "triton-sgmv" else ()
        label = "sgmv" if thr == 0 else f"hybrid@{label_thr}"
        if thr and not long:
            continue  # the same work as thr == 0
        variants[label] = (thr, tuple(n for _, n, _ in long))
    row["variants"] = {}
    for label, (thr, long_lens) in variants.items():
        triton_sgmv.TUNING["dense_min_seg"] = thr
        info.host_derived = {}
        for name, w in layers[0].items():
            o = outs[name].clone()
            auto.add_lora(o, xs[name], w, info)
            err = (o.float() - want[name]).abs().max().item()
            ok = torch.allclose(o.float(), want[name], atol=6e-2, rtol=4e-2)
            if not ok:
                print(f"MISMATCH {case} {label} {name}: max abs err {err:.3g}", file=sys.stderr)
                sys.exit(1)
        work = {name: o.clone() for name, o in outs.items()}

        def lora_layer(i: int, work: dict = work) -> None:
            layer = layers[i % len(layers)]
            for name, w in layer.items():
                auto.add_lora(work[name], xs[name], w, info)

        gpu_us, host_us = timed(lora_layer, args.repeats)
        row["variants"][label] = {
            "threshold": thr,
            "dense_segment_lens": list(long_lens),
            "gpu_us_per_layer": gpu_us,
            "host_us_per_layer": host_us,
            "effective_TBps": need / (gpu_us * 1e-6) / 1e12,
            "lora_over_base": gpu_us / row["base_us"],
        }
    triton_sgmv.TUNING["dense_min_seg"] = default_thr
    return row


t_start = time.perf_counter()
for case, reqs in CASES.items():
    results["cases"][case] = run_case(case, reqs)
    if cuda:
        torch.cuda.empty_cache()

results["wall_s"] = time.perf_counter() - t_start
results["default_threshold"] = default_thr
with open(args.out, "w") as f:
    json.dump(results, f, indent=1)

print(
    f"{results['device']}, {dtype}, rank {R}, {SLOTS} slots; us per layer (qkv+o+gate_up+down), median of {args.repeats}"
)
print(
    f"{'case':9} {'T':>5} {'segs':>4} {'base':>7}  {'variant':12} {'gpu':>7} {'host':>7} {'TB/s':>5} {'/base':>5}"
)
for case, row in results["cases"].items():
    first = True
    for label, v in row["variants"].items():
        lead = (
            f"{case:9} {row['tokens']:5d} {row['segments']:4d} {row['base_us']:7.1f}" if first else " " * 28
        )
        print(
            f"{lead}  {label:12} {v['gpu_us_per_layer']:7.1f} {v['host_us_per_layer']:7.1f} "
            f"{v['effective_TBps']:5.2f} {v['lora_over_base']:5.2f}"
        )
        first = False
print(f"all outputs matched torch-gather; wall {results['wall_s']:.1f} s; JSON in {args.out}")
