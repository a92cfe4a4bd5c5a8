"""``cpu_fused_lora`` on against off, one SmolLM2 forward at a time, interleaved call by call (issue 21).

On: each LoRA module's base GEMM and every slot's shrink are one oneDNN matmul over the stacked
``[W; A_live]`` (:mod:`mmlora.backends.cpu_dense`); off: the base layer's packed GEMM, then
``add_lora``'s shrink and expand. The step is :mod:`cpu_decode_step`'s (16 rows on four rank-8 adapters
and the base, or ``--prefill``), routed mixed and base-only; the four (routing, setting) pairs alternate
call by call and print per round the median ms of each. ``PackedLinear.release`` is a no-op here, so
both paths keep their packed weights while they alternate (speed only: the engine keeps one).

``--slot-load``: instead, the forward right after a slot load (every module's A written in place, as a
load does to the version counters) against the steady one, each setting in turn: what the repacking of
the stacked weights adds to the first forward after a load.

    PYTHONPATH=. python benchmarks/scripts/cpu_fused_lora_ab.py [--dtype bfloat16] [--prefill] [--slot-load]
"""

import contextlib
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks/scripts")
import cpu_decode_step as step  # noqa: E402

from mmlora.layers.packed_linear import PackedLinear  # noqa: E402
from mmlora.lora.layer import LoRALinear  # noqa: E402


def fused(ctx, on: bool):  # noqa: ANN001, ANN201
    """A context manager factory setting ``ctx.fuse_base`` (the engine's cpu_fused_lora) to ``on``."""

    @contextlib.contextmanager
    def cm():  # noqa: ANN202
        old, ctx.fuse_base = ctx.fuse_base, on
        try:
            yield
        finally:
            ctx.fuse_base = old

    return cm


def slot_load_cost(engine, batch, routing, rounds: int) -> dict[str, list[float]]:  # noqa: ANN001
    """Median ms of the forward after a (simulated) slot load and of the steady one, per setting."""
    mods = [m for m in engine.model.modules() if isinstance(m, LoRALinear)]
    ctx, res = engine.lora._ctx, {}
    with torch.inference_mode():
        for on in [True, False] * rounds:
            with fused(ctx, on)():
                for _ in range(2):
                    engine.runner.run_batch(batch, routing)
                after, steady = [], []
                for _ in range(4):
                    for m in mods:
                        m.weights.A.add_(0)  # bumps the version counters as a slot load's write does
                    for times in (after, steady):
                        t0 = time.perf_counter()
                        engine.runner.run_batch(batch, routing)
                        times.append(time.perf_counter() - t0)
            for name, times in (("after-load", after), ("steady", steady)):
                res.setdefault(f"{name}-{'on' if on else 'off'}", []).append(1e3 * statistics.median(times))
            print({k: round(v[-1], 1) for k, v in res.items()}, flush=True)
    return res


def main() -> None:
    argv = [a for a in sys.argv[1:] if a != "--slot-load"]
    args = step.parse(argv)
    PackedLinear.release = lambda self: None
    engine, batch, mixed, base = step.setup(args)
    ctx = engine.lora._ctx
    if "--slot-load" in sys.argv:
        res = slot_load_cost(engine, batch, mixed, args.rounds)
    else:
        with torch.inference_mode():
            outs = []
            for on in (False, True):
                with fused(ctx, on)():
                    outs.append(engine.runner.run_batch(batch, mixed).clone())
        print(f"mixed hidden states, max |on - off|: {(outs[1] - outs[0]).abs().max().item():.3g}")
        variants = {"off": fused(ctx, False), "on": fused(ctx, True)}
        res = step.measure(engine, batch, {"mixed": mixed, "base": base}, args.calls, args.rounds, variants)
        for v in variants:
            ratios = [b / m for b, m in zip(res[f"base-{v}"], res[f"mixed-{v}"])]
            print(f"{v}: base / mixed per round {', '.join(f'{r:.3f}' for r in ratios)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**vars(args), "slot_load": "--slot-load" in sys.argv, "median_ms": res}, f, indent=2)


if __name__ == "__main__":
    main()
