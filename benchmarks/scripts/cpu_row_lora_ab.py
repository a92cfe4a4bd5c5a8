"""CPU decode steps over many adapter slots: the per-row C LoRA (:mod:`mmlora.backends.cpu_row_lora`,
replayed from CPU decode plans) against torch-gather's per-slot torch path (eager: its index tensors keep
the step out of a plan), one engine, the arms alternating.

The engine (SmolLM2 shapes, ``dummy:smollm2-135m`` by default: no download) has ``--slots`` adapter slots and
``--loaded`` rank-``--rank`` adapters registered (more live rank rows than the fused dense path stacks, so
every LoRA module goes through ``add_lora``); ``--batch`` requests decode at context ``--context``, their
rows cycling over ``--distinct`` of the adapters (each value in turn, each round a new batch). Per round and
batch, each arm (``before``: ``cpu_row_lora.ENABLED`` False; ``after``: True) starts from a fresh plan state
(the runner's plans and refusals dropped), takes three untimed steps (eager, capture, replay) and then
``--steps`` timed ``engine.step()`` calls; prints the median ms of each and how many of them replayed a
plan, and the same for a base-only batch of the round, for reference. In the first round the two arms'
logits for one step are compared.

    PYTHONPATH=. python benchmarks/scripts/cpu_row_lora_ab.py [--distinct 2 32] [--dtype float32] [--rounds 2]
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
from mmlora.backends import cpu_row_lora
from mmlora.bench.adapters import write_random_adapters
from mmlora.bench.serving_parts import abort_all, start_decode_batch


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--loaded", type=int, default=32, help="adapters registered (and in slots)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--distinct", type=int, nargs="+", default=[2, 32])
    p.add_argument("--context", type=int, default=96)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    return p.parse_args()


def fresh_plans(engine: mmlora.Engine, on: bool) -> None:
    """Set the arm and drop what the plan runner remembers (a refused key would stay eager otherwise)."""
    cpu_row_lora.ENABLED = on
    graphs = engine.runner.decode_graphs
    graphs.plans.clear()
    graphs._ran.clear()
    graphs._refused.clear()


def timed_steps(engine: mmlora.Engine, steps: int) -> tuple[float, int]:
    """(median ms of ``steps`` engine steps after three untimed ones, plan replays among the timed)."""
    graphs = engine.runner.decode_graphs
    for _ in range(3):
        engine.step()
    replays0, times = graphs.num_plan_replays, []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), graphs.num_plan_replays - replays0


def compare_logits(engine: mmlora.Engine, n: int) -> float:
    """Max |after - before| over one step's logits, both arms run eagerly on the runner's static inputs."""
    outs = []
    for on in (False, True):
        cpu_row_lora.ENABLED = on
        outs.append(engine.runner.decode_graphs.eager_forward(n)[:n].float().clone())
    return (outs[1] - outs[0]).abs().max().item()


def main() -> None:
    args = parse()
    made = write_random_adapters(
        args.model, tempfile.mkdtemp(), args.loaded, [args.rank], dtype=args.dtype, distinct=args.loaded
    )
    engine = mmlora.Engine(
        model=args.model, lora_paths={m["name"]: m["path"] for m in made}, max_loras_per_batch=args.slots,
        max_lora_rank=args.rank, max_running_requests=2 * args.batch, device="cpu", dtype=args.dtype,
    )  # fmt: skip
    assert engine.runner.decode_graphs is not None, "CPU decode plans are off here"
    rng = np.random.default_rng(0)
    res: dict[str, list] = {}
    for r in range(args.rounds):
        for distinct in [0, *args.distinct]:  # base-only too, in every round, for reference
            names = [made[i % distinct]["name"] if distinct else None for i in range(args.batch)]
            rids = start_decode_batch(engine, names, args.context, rng)
            if distinct and r == 0:
                timed_steps(engine, 1)  # a plan in place, so the static inputs hold this batch
                diff = compare_logits(engine, args.batch)
                print(f"distinct {distinct}: max |logits after - before| {diff:.3g}", flush=True)
            for arm in ("before", "after") if distinct else ("base",):
                fresh_plans(engine, arm != "before")
                ms, replays = timed_steps(engine, args.steps)
                res.setdefault(f"{arm}-{distinct}", []).append(ms)
                print(
                    f"round {r} distinct {distinct} {arm}: {ms:.1f} ms ({replays}/{args.steps} replayed)",
                    flush=True,
                )
            abort_all(engine, rids)
    cpu_row_lora.ENABLED = True
    print(json.dumps({k: [round(v, 1) for v in vs] for k, vs in res.items()}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**vars(args), "torch_threads": torch.get_num_threads(), "median_ms": res}, f, indent=2)


if __name__ == "__main__":
    main()
