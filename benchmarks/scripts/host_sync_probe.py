"""Issue 13: does the host wait for the GPU while it launches a step?

Session 13 ran it at fae276b (call 3), with a switch that staged the step's inputs through pinned memory;
pageable and pinned gave the same stage times, so the staging was taken out again and this script now
times the engine as it is.

1. Small host-to-GPU copies (64 B to 1 MB), pageable and pinned, each queued behind a GPU sleep of
   ~100 ms: how long the host is held by the copy call.
2. One engine (dummy Mistral-7B, bf16, 32 rank-16 adapters): a prefill forward (32 prompts x 32 tokens,
   adapters cycled) and a decode step (32 rows, CUDA graph), each queued behind a GPU sleep of ~200 ms,
   with the host time of its stages (input build, first layer, last layer, the whole call) measured from
   the call's start, three rounds. A stage that takes about the sleep's length waited for the GPU.

    PYTHONPATH=. python benchmarks/scripts/host_sync_probe.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from lora_overlap_ab import engine_with_adapters

from mmlora.bench.serving_parts import abort_all, start_decode_batch

SLEEP_100MS = 200_000_000  # cycles; ~0.1 s at the H200's clock


def copy_probe() -> list[dict]:
    rows = []
    dev = torch.device("cuda")
    for nbytes in (64, 4096, 65536, 1 << 20):
        for pinned in (False, True):
            src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            held = []
            for _ in range(3):
                torch.cuda.synchronize()
                torch.cuda._sleep(SLEEP_100MS)
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                held.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            rows.append({"bytes": nbytes, "pinned": pinned, "host_ms": held})
            print(
                f"copy {nbytes} B {'pinned' if pinned else 'pageable'}: host held {[round(h, 3) for h in held]} ms"
            )
    return rows


def stage_probe(engine, fn, label: str) -> dict:  # noqa: ANN001
    """Host ms from the call's start to each stage, with ~0.2 s of GPU sleep queued first."""
    model = engine.runner.model
    layers = model.layers
    marks: dict[str, float] = {}
    t0 = 0.0
    wrapped = []

    def mark(name, f):  # noqa: ANN001, ANN202
        def g(*a, **k):  # noqa: ANN002, ANN003, ANN202
            out = f(*a, **k)
            marks.setdefault(name, (time.perf_counter() - t0) * 1e3)
            return out

        return g

    for name, obj, attr in (("first layer", layers[0], "forward"), ("last layer", layers[-1], "forward")):
        wrapped.append((obj, attr))
        setattr(obj, attr, mark(name, getattr(obj, attr)))
    runner = engine.runner
    if hasattr(runner, "build"):
        wrapped.append((runner, "build"))
        runner.build = mark("inputs built", runner.build)
    try:
        torch.cuda.synchronize()
        torch.cuda._sleep(2 * SLEEP_100MS)
        t0 = time.perf_counter()
        fn()
        marks["call returned"] = (time.perf_counter() - t0) * 1e3
    finally:
        for obj, attr in wrapped:
            delattr(obj, attr)
    torch.cuda.synchronize()
    print(f"{label}: " + ", ".join(f"{k} {v:.1f}" for k, v in marks.items()) + " ms")
    return marks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:mistral-7b-v0.3")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = {"copies": copy_probe(), "prefill": [], "decode": []}
    engine, _side, adapters = engine_with_adapters(args.model, 32, 32)
    rng = np.random.default_rng(0)
    names = [adapters[i % 32]["name"] for i in range(32)]
    prompts = [rng.integers(0, engine.model.arch.vocab_size, 32).tolist() for _ in range(32)]
    sp = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=prompts, lora_paths=names, sampling_params=sp)  # warm-up

    def prefill_forward() -> None:
        # One new token: the call's first forward is the prefill the stage marks time.
        engine.generate(input_ids=prompts, lora_paths=names, sampling_params=sp)

    for _ in range(args.rounds):
        engine.flush_cache()
        result["prefill"].append(stage_probe(engine, prefill_forward, "prefill"))
    rids = start_decode_batch(engine, names, 512, rng)
    engine.step()
    for _ in range(args.rounds):
        result["decode"].append(stage_probe(engine, engine.step, "decode step"))
    abort_all(engine, rids)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
