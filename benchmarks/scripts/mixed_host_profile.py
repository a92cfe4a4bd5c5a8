"""Host profile of the mixed steps replayed from graphs in a ``bench serving`` run (session 40).

The 1000-adapter runs of issue 13 spend 0.44-0.69 s launching their ~62 mixed-graph steps against
0.12-0.14 s in every other run, and the adapter uploads' host time explains only 0.06-0.11 s of it. This
runs ``python -m mmlora.bench serving`` with the given arguments under a cProfile of each
``MixedGraphRunner.run`` call, one profile for steps with an adapter row and one for base-only steps, and
writes both (top functions by total and cumulative time) with the calls' wall seconds into OUT every 10
calls, so a run cut short still leaves them.

    python benchmarks/scripts/mixed_host_profile.py OUT serving --model ... --num-adapters 1000 ...
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

from mmlora.bench.__main__ import main as bench_main
from mmlora.engine import mixed_graph


def _dump(out: Path, profiles: dict, walls: dict) -> None:
    for name, prof in profiles.items():
        if not walls[name]:
            continue
        text = io.StringIO()
        text.write(f"{name}: {len(walls[name])} calls, wall {sum(walls[name]):.3f} s\n")
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(30)
        (out / f"{name}.txt").write_text(text.getvalue())


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    profiles = {"lora": cProfile.Profile(), "base": cProfile.Profile()}
    walls: dict[str, list[float]] = {"lora": [], "base": []}
    run = mixed_graph.MixedGraphRunner.run

    def profiled(self, sched, future=None):  # noqa: ANN001, ANN202
        name = "lora" if any(r.slot >= 0 for r in sched.requests) else "base"
        t0 = time.perf_counter()
        profiles[name].enable()
        try:
            return run(self, sched, future)
        finally:
            profiles[name].disable()
            walls[name].append(time.perf_counter() - t0)
            if sum(map(len, walls.values())) % 10 == 0:
                _dump(out, profiles, walls)

    mixed_graph.MixedGraphRunner.run = profiled
    try:
        bench_main(sys.argv[2:])
    finally:
        _dump(out, profiles, walls)


if __name__ == "__main__":
    main()
