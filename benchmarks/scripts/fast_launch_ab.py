"""Direct Triton launches (mmlora.triton_launch) against Triton's own launch path, in one process.

Issue 13: the typical serving mixed step (127 decode rows plus one ~260-token prompt) is host-bound, and
Triton's per-launch host cost is most of it. Two parts, each alternating the two paths:

1. host us per call of one launch site: SGMV and BGMV ``add_lora`` (two kernels each) at Mistral-7B's qkv
   shape, and the RMSNorm kernel, with no sync in the loop (what an eager forward pays);
2. engine mixed steps on a dummy preset: ``--rows`` decode rows (on ``--adapters`` adapters, then
   base-only) plus one ``--chunk``-token prompt per step, the path switched every step; per path the
   median wall of ``engine.step()`` (synchronised), its GPU span and the host time of the forward call.

    PYTHONPATH=. python benchmarks/scripts/fast_launch_ab.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import torch

import mmlora
import mmlora.triton_launch as tl_launch
from mmlora.backends import get_backend
from mmlora.bench.adapters import write_random_adapters
from mmlora.bench.serving_parts import abort_all, record_forward_host, start_decode_batch, timed_step
from mmlora.forward import LoRABatchInfo, LoRAWeights
from mmlora.layers import fused_ops as F

PATHS = {"direct": True, "triton": False}


def host_us(fn, n: int = 200) -> float:  # noqa: ANN001
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def launch_sites(rounds: int) -> list[dict]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    S, R, in_f, offs = 32, 16, 4096, (0, 4096, 5120, 6144)
    A = (torch.randn(S, 3 * R, in_f, device=dev) / 64).to(dt)
    B = (torch.randn(S, offs[-1], R, device=dev) / 4).to(dt)
    weights = LoRAWeights(A, B, torch.full((S, 3), 2.0, device=dev), offs)
    sites = {}
    for label, lens, slots in (
        ("mixed: 127 decode rows + 260 prompt", [1] * 127 + [260], [i % 32 for i in range(127)] + [5]),
        ("decode: 32 rows on 32 adapters", [1] * 32, list(range(32))),
    ):
        T = sum(lens)
        info = LoRABatchInfo(T, S, dev)
        for s in range(S):
            info.set_slot_rank(s, R)
        info.fill(lens, slots)
        x = torch.randn(T, in_f, device=dev).to(dt)
        out = torch.zeros(T, offs[-1], device=dev, dtype=dt)
        for name in ("triton-sgmv", "triton-bgmv"):
            b = get_backend(name)
            sites[f"{name} add_lora, {label}"] = lambda b=b, out=out, x=x, info=info: b.add_lora(
                out, x, weights, info
            )
    x = torch.randn(387, in_f, device=dev).to(dt)
    w = torch.randn(in_f, device=dev).to(dt)
    sites["rms_norm, 387 rows"] = lambda: F.rms_norm_triton(x, w, 1e-6)
    rows = []
    for site, fn in sites.items():
        for k in range(rounds):
            for path, on in PATHS.items():
                tl_launch._FAST = on
                fn()
                rows.append({"site": site, "path": path, "round": k, "host_us": host_us(fn)})
        got = {p: max(r["host_us"] for r in rows if r["site"] == site and r["path"] == p) for p in PATHS}
        print(
            f"{site}: host us per call, worse round: direct {got['direct']:.1f}, triton {got['triton']:.1f}",
            flush=True,
        )
    tl_launch._FAST = True
    return rows


def mixed_steps(args: argparse.Namespace) -> list[dict]:
    made = write_random_adapters(args.model.removeprefix("dummy:"), tempfile.mkdtemp(), args.adapters, [16])
    paths = {m["name"]: m["path"] for m in made}
    names = list(paths)
    engine = mmlora.Engine(
        model=args.model, lora_paths=paths, max_loras_per_batch=args.adapters, max_lora_rank=16,
        max_running_requests=args.rows + 8, max_model_len=4096,
    )  # fmt: skip
    engine.tokenizer = None
    rng = np.random.default_rng(0)
    vocab = engine.model.arch.vocab_size
    forward_host = record_forward_host(engine)
    rows = []
    for case, lora_names in (("32 adapters", names), ("base-only", [None])):
        rids = start_decode_batch(
            engine, [lora_names[i % len(lora_names)] for i in range(args.rows)], 512, rng
        )
        for k in range(2 * args.steps + 4):
            path = "direct" if k % 2 == 0 else "triton"
            tl_launch._FAST = PATHS[path]
            engine.add_request(
                input_ids=rng.integers(0, vocab, args.chunk).tolist(), lora=lora_names[k % len(lora_names)],
                sampling_params={"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True},
            )  # fmt: skip
            forward_host.clear()
            wall, span = timed_step(engine)
            if k >= 4:  # the first two of each path compile nothing but fill the direct path's cache
                rows.append({
                    "case": case, "path": path, "wall_ms": wall * 1e3, "gpu_span_ms": span * 1e3,
                    "forward_host_ms": sum(forward_host) * 1e3,
                })  # fmt: skip
        abort_all(engine, rids)
        for path in PATHS:
            mine = [r for r in rows if r["case"] == case and r["path"] == path]
            print(
                f"{case}, {path}: mixed step wall {statistics.median(r['wall_ms'] for r in mine):.1f} ms, "
                f"GPU span {statistics.median(r['gpu_span_ms'] for r in mine):.1f} ms, forward host "
                f"{statistics.median(r['forward_host_ms'] for r in mine):.1f} ms (median of {len(mine)})",
                flush=True,
            )
    tl_launch._FAST = True
    engine.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:mistral-7b-v0.3")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--rows", type=int, default=127)
    p.add_argument("--chunk", type=int, default=260)
    p.add_argument("--steps", type=int, default=10, help="mixed steps per path and case")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    assert tl_launch._FAST, "the direct path is off here"
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "args": vars(args),
        "launch_sites": launch_sites(args.rounds),
        "mixed_steps": mixed_steps(args),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
