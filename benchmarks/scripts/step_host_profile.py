"""Where the host time of a CUDA-graph decode step goes (issue 13: the engine step is 1-5 ms longer than
its graph replay). Builds a base-only engine on a dummy preset, starts B decode requests at a context of
C tokens, then times and cProfiles N engine steps; prints the step and replay times and the top entries.

    PYTHONPATH=. python benchmarks/scripts/step_host_profile.py [--model dummy:mistral-7b-v0.3] [--batch 128] [--adapters 32]

``--callees``: also the callees and callers of ``__exit__`` (session 9's H200 profile charged 95 ms of 20
steps to ``inference_mode.__exit__``) and torch.profiler's CPU ops of 5 steps by self time.
"""

import argparse
import cProfile
import io
import pstats
import tempfile

import numpy as np

import mmlora
from mmlora.bench.adapters import write_random_adapters
from mmlora.bench.serving_parts import mean_step_seconds, start_decode_batch, time_graph_replay

p = argparse.ArgumentParser()
p.add_argument("--model", default="dummy:mistral-7b-v0.3")
p.add_argument("--batch", type=int, default=128)
p.add_argument("--context", type=int, default=768)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--callees", action="store_true")
p.add_argument("--adapters", type=int, default=0, help="rows cycle over this many random rank-16 adapters")
args = p.parse_args()
names: list = [None]
paths = None
if args.adapters:
    made = write_random_adapters(args.model.removeprefix("dummy:"), tempfile.mkdtemp(), args.adapters, [16])
    paths = {m["name"]: m["path"] for m in made}
    names = list(paths)
engine = mmlora.Engine(
    model=args.model, lora_paths=paths, max_loras_per_batch=max(8, args.adapters), max_lora_rank=16,
    max_running_requests=args.batch, max_model_len=4096,
)  # fmt: skip
engine.tokenizer = None  # as the serving benchmark (its requests are random ids)
start_decode_batch(
    engine, [names[i % len(names)] for i in range(args.batch)], args.context, np.random.default_rng(0)
)
step_ms = mean_step_seconds(engine, args.steps) * 1e3
replay_ms = (time_graph_replay(engine) or float("nan")) * 1e3
prof = cProfile.Profile()
prof.enable()
for _ in range(args.steps):
    engine.step()
prof.disable()
print(
    f"B={args.batch} context={args.context} adapters={args.adapters}: engine step {step_ms:.2f} ms, graph replay {replay_ms:.2f} ms"
)
for key in ("tottime", "cumulative"):
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(key).print_stats(30)
    print(s.getvalue())
if args.callees:
    from torch.profiler import ProfilerActivity, profile

    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s).sort_stats("cumulative")
    stats.print_callees("__exit__")
    stats.print_callers("__exit__")
    print(s.getvalue())
    with profile(activities=[ProfilerActivity.CPU]) as tprof:
        for _ in range(5):
            engine.step()
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
