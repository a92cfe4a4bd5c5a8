"""Issue 21: where one CPU decode forward's time goes, per C kernel entry point, fp32 and bf16.

The forward of ``cpu_decode_step.py`` (SmolLM2-135M, 16 rows at context 96, four rank-8 adapters and base
rows) runs ``--forwards`` times after 5 warm-up ones, with each entry point of
``mmlora.bench.cpu_roofline.C_ENTRY_POINTS`` timed from Python (ctypes and the wrapper included). Prints
the forward's median and the mean ms per forward in each entry point; the rest is Python and torch.

    PYTHONPATH=. python benchmarks/scripts/cpu_c_entry_times.py [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_decode_step  # noqa: E402

from mmlora.bench.cpu_roofline import C_ENTRY_POINTS  # noqa: E402

SPENT: dict[str, float] = collections.defaultdict(float)


def _timed(owner: object, name: str) -> None:
    fn = getattr(owner, name)
    label = "expand" if name == "__call__" else name.removesuffix("_unchecked")

    def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - t0

    setattr(owner, name, call)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--forwards", type=int, default=30)
    args = p.parse_args()
    for owner, name in C_ENTRY_POINTS:
        _timed(owner, name)
    for dtype in args.dtypes:
        engine, batch, mixed, _ = cpu_decode_step.setup(cpu_decode_step.parse(["--dtype", dtype]))
        with torch.inference_mode():
            for _ in range(5):
                engine.runner.run_batch(batch, mixed)
            SPENT.clear()
            walls = []
            for _ in range(args.forwards):
                t0 = time.perf_counter()
                engine.runner.run_batch(batch, mixed)
                walls.append(time.perf_counter() - t0)
        per = {k: round(1e3 * v / args.forwards, 2) for k, v in SPENT.items()}
        inside = sum(per.values())
        print(
            f"{dtype}: forward median {1e3 * statistics.median(walls):.2f} ms; in C entry points {per} "
            f"= {inside:.2f} ms; outside {1e3 * statistics.median(walls) - inside:.2f} ms",
            flush=True,
        )
        del engine


if __name__ == "__main__":
    main()
