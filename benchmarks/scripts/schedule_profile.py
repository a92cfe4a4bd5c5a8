"""Where ``Scheduler.schedule``'s host time goes in a serving run (issue 13: at 1000 adapters on the H200 it
took 444-874 ms a run against 182-332 base-only, and a faster ``PageMap.choose`` did not move it). Runs
``python -m mmlora.bench serving`` in this process with the given arguments, every ``schedule`` call under
cProfile, and prints the profile's top functions by cumulative and by own time.

    PYTHONPATH=. python benchmarks/scripts/schedule_profile.py --top 30 -- <bench serving arguments>
"""

import argparse
import cProfile
import io
import pstats
import sys

from mmlora.bench.serving import main as serving_main
from mmlora.engine.scheduler import Scheduler

p = argparse.ArgumentParser()
p.add_argument("--top", type=int, default=30)
argv = sys.argv[1:]
split = argv.index("--") if "--" in argv else len(argv)
args = p.parse_args(argv[:split])
profile = cProfile.Profile()
schedule = Scheduler.schedule


def profiled_schedule(self: Scheduler):  # noqa: ANN201
    profile.enable()
    try:
        return schedule(self)
    finally:
        profile.disable()


Scheduler.schedule = profiled_schedule
serving_main(argv[split + 1 :])
for key in ("cumulative", "tottime"):
    buf = io.StringIO()
    pstats.Stats(profile, stream=buf).sort_stats(key).print_stats(args.top)
    print(f"== schedule, by {key}\n" + buf.getvalue())
