"""Issue 13 item 5: what a B-row decode step's host time is made of, below the functions cProfile names.
Session 9's profile (call 3) charged 95 ms of 20 steps' host time to ``inference_mode.__exit__``; this
prints that entry's callees, then torch.profiler's CPU ops of 5 steps by self time (base-only engine on
a dummy preset, B decode requests at context C).

    PYTHONPATH=. python benchmarks/scripts/step_callees.py [--batch 128] [--context 768]
"""

import argparse
import cProfile
import io
import pstats

import numpy as np
from torch.profiler import ProfilerActivity, profile

import mmlora
from mmlora.bench.serving_parts import start_decode_batch

p = argparse.ArgumentParser()
p.add_argument("--model", default="dummy:mistral-7b-v0.3")
p.add_argument("--batch", type=int, default=128)
p.add_argument("--context", type=int, default=768)
args = p.parse_args()
engine = mmlora.Engine(model=args.model, max_running_requests=args.batch, max_model_len=2048)
start_decode_batch(engine, [None] * args.batch, args.context, np.random.default_rng(0))
for _ in range(3):
    engine.step()
prof = cProfile.Profile()
prof.enable()
for _ in range(10):
    engine.step()
prof.disable()
s = io.StringIO()
stats = pstats.Stats(prof, stream=s).sort_stats("cumulative")
stats.print_callees("__exit__")
stats.print_callers("__exit__")
print(s.getvalue()[:6000])
with profile(activities=[ProfilerActivity.CPU]) as tprof:
    for _ in range(5):
        engine.step()
print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
