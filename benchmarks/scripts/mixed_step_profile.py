"""Where the host time of an eager mixed step goes (issue 13: on the H200 a base-only mixed step spends
27-41 ms launching its forward, about as long as its GPU span, and that launch time moves 40% between
runs). Builds an engine on a dummy preset, starts B decode requests (on ``--adapters`` random adapters,
or base-only with 0), then runs steps that each add one ``--chunk``-token prompt (max_new_tokens 1), so
every step is B decode rows plus one prefill chunk. Prints per step: wall, GPU span (events), and the
host time of the forward call; then a cProfile of N such steps (top by own time) and a torch.profiler
table of one step's CPU ops (self time), which shows launches, copies and any synchronisation.

    PYTHONPATH=. python benchmarks/scripts/mixed_step_profile.py [--adapters 32] [--batch 128]
"""

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time

import numpy as np
from torch.profiler import ProfilerActivity, profile

import mmlora
from mmlora.bench.adapters import write_random_adapters
from mmlora.bench.serving_parts import record_forward_host, start_decode_batch, timed_step

p = argparse.ArgumentParser()
p.add_argument("--model", default="dummy:mistral-7b-v0.3")
p.add_argument("--adapters", type=int, default=32)
p.add_argument("--batch", type=int, default=128)
p.add_argument("--chunk", type=int, default=2048)
p.add_argument("--steps", type=int, default=8)
args = p.parse_args()
names, paths = [None], {}
if args.adapters:
    made = write_random_adapters(args.model.removeprefix("dummy:"), tempfile.mkdtemp(), args.adapters, [16])
    paths = {m["name"]: m["path"] for m in made}
    names = list(paths)
engine = mmlora.Engine(
    model=args.model, lora_paths=paths or None, max_loras_per_batch=max(8, args.adapters),
    max_lora_rank=16, max_running_requests=args.batch + 8, max_model_len=min(4096, 2 * args.chunk + 1024),
)  # fmt: skip
cuda = engine.device.type == "cuda"
rng = np.random.default_rng(0)
vocab = engine.model.arch.vocab_size
start_decode_batch(engine, [names[i % len(names)] for i in range(args.batch)], 512, rng)
forward_host = record_forward_host(engine)


def mixed_step() -> tuple[float, float]:
    engine.add_request(
        input_ids=rng.integers(0, vocab, args.chunk).tolist(), lora=names[0],
        sampling_params={"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True},
    )  # fmt: skip
    if not cuda:  # a CPU check of the script: no GPU span
        t0 = time.perf_counter()
        engine.step()
        return time.perf_counter() - t0, float("nan")
    return timed_step(engine)


for _ in range(3):
    mixed_step()
forward_host.clear()
walls, spans = zip(*(mixed_step() for _ in range(args.steps)))
print(
    f"adapters={args.adapters} B={args.batch} chunk={args.chunk}: step wall {statistics.median(walls) * 1e3:.1f} "
    f"ms, GPU span {statistics.median(spans) * 1e3:.1f} ms, forward host {statistics.median(forward_host) * 1e3:.1f} ms"
)
prof = cProfile.Profile()
prof.enable()
for _ in range(args.steps):
    mixed_step()
prof.disable()
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
print(s.getvalue())
with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as tprof:
    mixed_step()
print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
