"""One SmolLM2 CPU forward (:mod:`cpu_decode_step`'s step) at two torch thread counts, interleaved call by
call in one process (``torch.set_num_threads`` before each call), mixed and base-only routings: what
thread count a decode step wants on this host.

    PYTHONPATH=. python benchmarks/scripts/cpu_threads_ab.py [--dtype bfloat16] [--rounds 2] [--out FILE]
"""

import contextlib
import json
import sys

import torch

sys.path.insert(0, "benchmarks/scripts")
import cpu_decode_step as step  # noqa: E402


def threads(n: int):  # noqa: ANN201
    @contextlib.contextmanager
    def cm():  # noqa: ANN202
        old = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(old)

    return cm


def main() -> None:
    args = step.parse()
    engine, batch, mixed, base = step.setup(args)
    counts = sorted({1, torch.get_num_threads()})
    variants = {f"t{n}": threads(n) for n in counts}
    res = step.measure(engine, batch, {"mixed": mixed, "base": base}, args.calls, args.rounds, variants)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**vars(args), "thread_counts": counts, "median_ms": res}, f, indent=2)


if __name__ == "__main__":
    main()
