"""One CPU decode (or prefill) forward of SmolLM2-135M (issue 21): mixed adapters against base-only,
interleaved.

16 requests decode at a context of ``--context`` tokens; their rows cycle over four random rank-8
adapters on all seven projections and the base model (as ``python -m mmlora.bench cpu``). The step's
ForwardBatch is built once and the model forward runs on it again and again (a decode forward only
rewrites its own K/V, so every call does the same work), routed either as the mixed batch or with every
row base-only: the same attention and base GEMMs, only the LoRA work differs. The two alternate call by
call, so a burst of other load on the host hits both; prints per round the median ms of each and their
ratio. ``--prefill``: the same for the step that prefills all the prompts (``--context`` tokens each).
``variants`` (a dict of name -> context manager factory) lets an A/B script time code variants in
the same interleaving (see :func:`measure`).

    PYTHONPATH=. python benchmarks/scripts/cpu_decode_step.py [--dtype float32] [--rounds 2] [--profile]
"""

import argparse
import contextlib
import json
import statistics
import tempfile
import time

import numpy as np
import torch

import mmlora
from mmlora.bench.adapters import write_random_adapters
from mmlora.distributed.step import StepRouting


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=96)
    p.add_argument("--calls", type=int, default=20, help="forwards of each kind per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prefill", action="store_true", help="time the prefill step instead of a decode step")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of mixed forwards")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def setup(args: argparse.Namespace):  # noqa: ANN201
    """The engine, one decode (``args.prefill``: prefill) step's ForwardBatch, and the mixed and
    base-only routings of it."""
    made = write_random_adapters("smollm2-135m", tempfile.mkdtemp(), 4, [8], dtype="float32")
    paths = {m["name"]: m["path"] for m in made}
    engine = mmlora.Engine(
        model=args.model, lora_paths=paths, max_loras_per_batch=4, max_lora_rank=8,
        max_running_requests=64, device="cpu", dtype=args.dtype,
    )  # fmt: skip
    names = [*paths, None]
    rng = np.random.default_rng(0)
    vocab = engine.model.arch.vocab_size
    sp = {"max_new_tokens": 1000, "temperature": 0.0, "ignore_eos": True}
    for i in range(args.batch):
        ids = rng.integers(0, vocab, args.context).tolist()
        engine.add_request(input_ids=ids, lora=names[i % len(names)], sampling_params=sp)
    while not args.prefill and (
        engine.scheduler.waiting
        or any(r.num_computed < r.num_tokens - 1 or not r.output_ids for r in engine.scheduler.running)
    ):
        engine.step()
    sched, _ = engine.scheduler.schedule()
    batch, _ = engine.runner.build(sched)
    mixed = StepRouting(list(sched.num_new), [r.slot for r in sched.requests])
    base = StepRouting(list(sched.num_new), [-1] * len(sched))
    return engine, batch, mixed, base


def measure(engine, batch, routings: dict, calls: int, rounds: int, variants: dict | None = None) -> dict:  # noqa: ANN001
    """Median ms per forward of every (routing, variant) pair, per round, interleaved call by call."""
    variants = variants or {"": contextlib.nullcontext}
    runner = engine.runner
    kinds = [(f"{r}{'-' if v else ''}{v}", routings[r], variants[v]) for v in variants for r in routings]
    res: dict[str, list[float]] = {k: [] for k, _, _ in kinds}
    with torch.inference_mode():
        for _name, routing, variant in kinds:  # warm-up: primitives, caches
            with variant():
                for _ in range(3):
                    runner.run_batch(batch, routing)
        for r in range(rounds):
            times: dict[str, list[float]] = {k: [] for k, _, _ in kinds}
            for _ in range(calls):
                for name, routing, variant in kinds:
                    with variant():
                        t0 = time.perf_counter()
                        runner.run_batch(batch, routing)
                        times[name].append(time.perf_counter() - t0)
            for k, v in times.items():
                res[k].append(1e3 * statistics.median(v))
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in res.items()), flush=True)
    return res


def main() -> None:
    args = parse()
    engine, batch, mixed, base = setup(args)
    res = measure(engine, batch, {"mixed": mixed, "base": base}, args.calls, args.rounds)
    ratios = [b / m for b, m in zip(res["base"], res["mixed"])]
    print(f"base / mixed per round: {', '.join(f'{x:.3f}' for x in ratios)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**vars(args), "median_ms": res, "base_over_mixed": ratios}, f, indent=2)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.runner.run_batch(batch, mixed)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
