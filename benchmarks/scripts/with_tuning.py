"""``python -m mmlora.bench`` with Triton backends' TUNING knobs overridden in the process: a launch knob
tried at serving scale before it becomes a default.

    PYTHONPATH=. python benchmarks/scripts/with_tuning.py triton-sgmv:run_expand_group=4 ... -- serving ...

Each override is ``BACKEND:KNOB=JSON``; an unknown backend or knob is an error. The overrides are printed
first, so the run's log says what it ran with.
"""

from __future__ import annotations

import sys

from mmlora.backends.tuning import parse_override


def apply(spec: str) -> tuple[str, str, object]:
    table, knob, value = parse_override(spec)
    table[knob] = value
    return spec.partition(":")[0], knob, value


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    for spec in argv[:cut]:
        print("tuning override:", *apply(spec), flush=True)
    from mmlora.bench.__main__ import main as bench_main

    return bench_main(argv[cut + 1 :]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
