"""``python -m mmlora.bench`` with Triton backends' TUNING knobs overridden in the process: a launch knob
tried at serving scale before it becomes a default.

    PYTHONPATH=. python benchmarks/scripts/with_tuning.py triton-sgmv:run_expand_group=4 ... -- serving ...

Each override is ``BACKEND:KNOB=JSON``; an unknown backend or knob is an error. The overrides are printed
first, so the run's log says what it ran with.
"""

from __future__ import annotations

import json
import sys

from mmlora.backends import triton_bgmv, triton_sgmv

TABLES = {
    "triton-sgmv": triton_sgmv.TUNING,
    "triton-bgmv": triton_bgmv.TUNING,
}


def apply(spec: str) -> tuple[str, str, object]:
    backend, _, setting = spec.partition(":")
    knob, eq, value = setting.partition("=")
    if backend not in TABLES or not eq:
        raise SystemExit(
            f"override {spec!r}: expected BACKEND:KNOB=JSON with BACKEND one of {sorted(TABLES)}"
        )
    table = TABLES[backend]
    if knob not in table:
        raise SystemExit(f"override {spec!r}: {backend} has no knob {knob!r} (knobs: {sorted(table)})")
    table[knob] = json.loads(value)
    return backend, knob, table[knob]


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
