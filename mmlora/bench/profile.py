"""``python -m mmlora.bench profile``: where the time of one decode step goes, by kernel family.

For each batch size B (``--batch 32 128``), with and without LoRA (each request on its own adapter of rank
``--rank``), B requests are prefilled to ``--context`` tokens and one decode step is then:

- timed as a CUDA-graph replay (what serving runs), against its roofline floor (weights + KV read + the
  distinct adapters' bytes over the copy bandwidth measured in this run);
- profiled with ``torch.profiler`` while the very same captured forward runs eagerly on the graph's static
  inputs (identical kernels and shapes; the profiler sees each kernel), summed per kernel and per family:
  GEMM, LoRA, attention, fused ops, torch elementwise / reductions, other. The sum of kernel time against
  the replay time shows what launch gaps are left inside the graph.

Writes ``profile.json`` into ``--out`` and prints one table per configuration. CUDA only.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmlora.bench.adapters import write_random_adapters
from mmlora.bench.cli import check_engine_options, make_parser, progress
from mmlora.bench.serving_parts import (
    StepRecorder,
    abort_all,
    copy_bandwidth,
    start_decode_batch,
    time_graph_replay,
    weight_bytes,
)

#: Kernel name -> family, first match wins. Names are cuBLAS / CUTLASS / Triton / ATen kernel names.
FAMILIES: tuple[tuple[str, str], ...] = (
    ("lora", r"bgmv|sgmv|lora"),
    ("attention", r"decode|prefill|attn|attention|store_kv|flash"),
    ("fused ops", r"rms_norm|rotary|silu_and_mul|gelu_tanh_and_mul|fused"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|cublas|sm\d+_|splitK|Kernel2"),
    ("torch elementwise", r"elementwise|vectorized|unrolled|reduce_kernel|index|cat|copy|fill|where"),
)


def family(kernel: str) -> str:
    """The family of a kernel name (``other`` when no rule matches)."""
    for name, pattern in FAMILIES:
        if re.search(pattern, kernel, flags=re.IGNORECASE):
            return name
    return "other"


def _device_time_us(evt: Any) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
        value = getattr(evt, attr, None)
        if value:
            return float(value)
    return 0.0


def kernel_table(prof: torch.profiler.profile, steps: int) -> list[dict[str, Any]]:
    """Per kernel name: microseconds and launches per step, and its family; largest first."""
    rows = []
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = _device_time_us(evt)
        if us <= 0:
            continue
        rows.append(
            {"kernel": evt.key, "family": family(evt.key), "us": us / steps, "launches": evt.count / steps}
        )
    return sorted(rows, key=lambda r: -r["us"])


def _profile(fn: Any, steps: int) -> list[dict[str, Any]]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return kernel_table(prof, steps)


def _by_family(kernels: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for k in kernels:
        f = out.setdefault(k["family"], {"ms": 0.0, "launches": 0.0})
        f["ms"] += k["us"] / 1e3
        f["launches"] += k["launches"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = make_parser("python -m mmlora.bench profile", __doc__.split("\n\n")[0])
    p.add_argument("--model", default="dummy:mistral-7b-v0.3")
    p.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    p.add_argument("--context", type=int, default=768)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lora-backend", default="triton-bgmv")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--steps", type=int, default=5, help="profiled steps per configuration")
    p.add_argument("--top", type=int, default=12, help="kernels printed per configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-profile")
    args = p.parse_args(argv)
    if any(b < 1 for b in args.batch) or args.context < 2 or args.rank < 1 or args.steps < 1:
        raise ValueError("--batch and --rank must be >= 1, --context >= 2, --steps >= 1")
    check_engine_options(
        model=args.model, lora_backend=args.lora_backend, attention_backend=args.attention_backend
    )
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    import mmlora

    if not torch.cuda.is_available():
        raise SystemExit("python -m mmlora.bench profile needs a CUDA device")
    t_start = time.perf_counter()
    max_b = max(args.batch)
    engine = mmlora.Engine(
        model=args.model,
        device="cuda",
        dtype="bfloat16",
        max_loras_per_batch=max_b,
        max_lora_rank=args.rank,
        lora_backend=args.lora_backend,
        attention_backend=args.attention_backend,
        max_running_requests=max_b,
        max_model_len=max(4096, args.context + 64),
        seed=args.seed,
    )
    engine.tokenizer = None
    dtype = engine.model.lm_head.weight.dtype
    bw = copy_bandwidth(engine.device)
    recorder = StepRecorder(engine, weight_bytes(engine.model), dtype)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_random_adapters(
            engine.hf_config, tmp, max_b, [args.rank], dtype=dtype, seed=args.seed
        )
        for a in adapters:
            engine.load_lora(a["name"], a["path"])
        configs = []
        for bsz in progress(args.batch, "batch sizes"):
            for with_lora in (True, False):
                names = [a["name"] for a in adapters[:bsz]] if with_lora else [None] * bsz
                rids = start_decode_batch(engine, names, args.context, rng)
                for _ in range(3):
                    engine.step()  # graph replays: the static inputs now hold this batch
                running = list(engine.scheduler.running)
                ctx = sum(r.num_computed + 1 for r in running)
                ranks = [r.lora.rank for r in running if r.lora is not None]
                floor_ms = recorder.floor_seconds(ctx, ranks, bw) * 1e3
                replay = time_graph_replay(engine)
                graphs = engine.runner.decode_graphs
                bucket = next(b for b in graphs.buckets if b >= len(running))
                kernels = _profile(functools.partial(graphs.eager_forward, bucket), args.steps)
                abort_all(engine, rids)
                kernel_ms = sum(k["us"] for k in kernels) / 1e3
                row = {
                    "batch": bsz,
                    "lora": with_lora,
                    "context": args.context,
                    "replay_ms": None if replay is None else replay * 1e3,
                    "floor_ms": floor_ms,
                    "replay_over_floor": None if replay is None else replay * 1e3 / floor_ms,
                    "kernel_sum_ms": kernel_ms,
                    "launches": sum(k["launches"] for k in kernels),
                    "families": _by_family(kernels),
                    "kernels": kernels[:40],
                }
                configs.append(row)
                _print(row, args.top)
    return {
        "benchmark": "profile",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name(engine.device),
        "torch": torch.__version__,
        "args": dict(vars(args)),
        "copy_bandwidth_bytes_per_s": bw,
        "weight_bytes": recorder.weights,
        "configs": configs,
        "wall_s": time.perf_counter() - t_start,
    }


def _print(row: dict[str, Any], top: int) -> None:
    replay = "n/a" if row["replay_ms"] is None else f"{row['replay_ms']:.2f} ms"
    print(
        f"\n== B={row['batch']} lora={row['lora']}: replay {replay}, floor {row['floor_ms']:.2f} ms, "
        f"kernels {row['kernel_sum_ms']:.2f} ms in {row['launches']:.0f} launches",
        flush=True,
    )
    for name, f in row["families"].items():
        print(f"  {name:18s} {f['ms']:7.3f} ms  {f['launches']:6.0f} launches")
    for k in row["kernels"][:top]:
        print(f"    {k['us']:8.1f} us x{k['launches']:5.0f}  [{k['family']}] {k['kernel'][:90]}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'profile.json'} ({result['wall_s']:.0f} s)")
    return result
