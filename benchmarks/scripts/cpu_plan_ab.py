"""Issue 21: one CPU decode step replayed from its recorded plan against the same step run eagerly.

``cpu_decode_step.py``'s batch (SmolLM2-135M, 16 rows at context 96, four rank-8 adapters and base rows)
goes through the engine's CPU graph runner (``mmlora.engine.cpu_graph``): the step's forward over the
runner's static buffers, eagerly (``eager_forward``: every layer's Python and each kernel's ctypes call)
and replayed (``run``: one C call per run of kernels), interleaved call by call. Prints per round the
median ms of each and their ratio, whether the two give the same logits bit for bit, and the replayed
step's kernels as timed in C (``cpu_plan.timed``).

    PYTHONPATH=. python benchmarks/scripts/cpu_plan_ab.py [--dtypes float32 bfloat16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_decode_step  # noqa: E402

from mmlora.backends import cpu_plan  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    for dtype in args.dtypes:
        engine, _, _, _ = cpu_decode_step.setup(cpu_decode_step.parse(["--dtype", dtype]))
        graphs = engine.runner.decode_graphs
        sched, _ = engine.scheduler.schedule()
        n = len(sched)
        with torch.inference_mode():
            for _ in range(3):  # eager, captured, replayed
                replayed, _ = graphs.run(sched)
            same = torch.equal(replayed.clone(), graphs.eager_forward(n)[:n])
            for r in range(args.rounds):
                times: dict[str, list[float]] = {"eager": [], "replayed": []}
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    graphs.eager_forward(n)
                    t1 = time.perf_counter()
                    graphs.run(sched)
                    t2 = time.perf_counter()
                    times["eager"].append(t1 - t0)
                    times["replayed"].append(t2 - t1)
                eager, replay = (1e3 * statistics.median(times[k]) for k in ("eager", "replayed"))
                print(f"{dtype} round {r}: eager {eager:.2f} ms, replayed {replay:.2f} ms, "
                      f"ratio {replay / eager:.3f}", flush=True)  # fmt: skip
            with cpu_plan.timed() as kernels:
                for _ in range(10):
                    graphs.run(sched)
        per = {k: round(100 * t, 2) for k, (_, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])}
        print(f"{dtype}: logits bit-equal {same}; replayed kernels, ms per step: {per} "
              f"= {sum(per.values()):.2f}", flush=True)  # fmt: skip
        engine.close()


if __name__ == "__main__":
    main()
