"""The CPU C kernels at another commit against the working tree's, one SmolLM2 forward at a time,
interleaved call by call (issue 21).

Both sources are compiled (as :mod:`mmlora.backends.cpu_kernels` compiles its own) and loaded side by
side; a variant swaps which library the module's entry points call. Callers that keep their own function
pointers across calls (the LoRA expand's per-module calls) keep the working tree's, so this times the
attention, RMSNorm, rotary and K/V-store kernels. The step is :mod:`cpu_decode_step`'s (16 rows on four
rank-8 adapters and the base at ``--context``), routed mixed; prints per round the median ms of each.

    PYTHONPATH=. python benchmarks/scripts/cpu_source_ab.py --base HEAD [--dtype bfloat16] [--out F]
"""

import contextlib
import json
import subprocess
import sys

sys.path.insert(0, "benchmarks/scripts")
import cpu_decode_step as step  # noqa: E402

from mmlora.backends import cpu_kernels  # noqa: E402


def load_library(source: str):  # noqa: ANN201
    """The kernels compiled from ``source`` (cached by digest like the module's own)."""
    own = cpu_kernels._SOURCE
    cpu_kernels._SOURCE = source
    cpu_kernels._library.cache_clear()
    try:
        lib = cpu_kernels._library()
    finally:
        cpu_kernels._SOURCE = own
        cpu_kernels._library.cache_clear()
    if lib is None:
        raise RuntimeError("the CPU kernels could not be built here")
    return lib


def main() -> None:
    argv = sys.argv[1:]
    base = argv[argv.index("--base") + 1] if "--base" in argv else "HEAD"
    if "--base" in argv:
        i = argv.index("--base")
        del argv[i : i + 2]
    args = step.parse(argv)
    old_src = subprocess.run(
        ["git", "show", f"{base}:mmlora/backends/cpu_kernels.c"], check=True, capture_output=True, text=True
    ).stdout
    libs = {"tree": load_library(cpu_kernels._SOURCE), base: load_library(old_src)}
    original = cpu_kernels._library

    def using(name: str):  # noqa: ANN202
        @contextlib.contextmanager
        def cm():  # noqa: ANN202
            cpu_kernels._library = lambda: libs[name]
            try:
                yield
            finally:
                cpu_kernels._library = original

        return cm

    engine, batch, mixed, _ = step.setup(args)
    res = step.measure(engine, batch, {"mixed": mixed}, args.calls, args.rounds, {n: using(n) for n in libs})
    print("tree / base per round: " + ", ".join(
        f"{t / b:.3f}" for t, b in zip(res["mixed-tree"], res[f"mixed-{base}"])
    ))  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**vars(args), "base": base, "median_ms": res}, f, indent=2)


if __name__ == "__main__":
    main()
