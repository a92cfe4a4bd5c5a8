"""Host time of an adapter's slot load with the device idle and with the main stream busy (as under the
overlap scheduler, where a launched step is still running when the next step admits requests), and
torch.profiler's CPU and CUDA-runtime calls of the busy loads: which call waits.

    PYTHONPATH=. python benchmarks/scripts/upload_host_profile.py [--model dummy:mistral-7b-v0.3]
"""

import argparse
import json
import tempfile
import time

import torch

import mmlora
from mmlora.bench.adapters import write_random_adapters

p = argparse.ArgumentParser()
p.add_argument("--model", default="dummy:mistral-7b-v0.3")
p.add_argument("--busy-ms", type=float, default=20.0)
p.add_argument("--reps", type=int, default=8)
p.add_argument("--out", default=None)
args = p.parse_args()
made = write_random_adapters(args.model.removeprefix("dummy:"), tempfile.mkdtemp(), 6, [16])
paths = {m["name"]: m["path"] for m in made}
engine = mmlora.Engine(
    model=args.model, lora_paths=paths, max_loras_per_batch=2, max_lora_rank=16, max_running_requests=8,
    max_model_len=2048,
)  # fmt: skip
lora = engine.lora
pool = lora._pool
entries = [lora.resolve(n) for n in paths]
for e in entries:  # every host copy staged first: only the slot loads are timed
    pool.put_host(e.uid, lora._read(e.path), set())
# cycles of torch.cuda._sleep per ms, measured
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
torch.cuda._sleep(10_000_000)
end.record()
end.synchronize()
cycles_per_ms = 10_000_000 / start.elapsed_time(end)
k = 0


def load(busy_ms: float) -> float:
    global k
    entry = entries[k % len(entries)]
    k += 1
    torch.cuda.synchronize()
    if busy_ms:
        torch.cuda._sleep(int(busy_ms * cycles_per_ms))
    t0 = time.perf_counter()
    lora.admit(entry, set())
    took = time.perf_counter() - t0
    torch.cuda.synchronize()
    return took * 1e3


for _ in range(4):
    load(0)
rows = {"idle": [], "busy": []}
for _ in range(args.reps):
    rows["idle"].append(load(0))
    rows["busy"].append(load(args.busy_ms))
for name, ms in rows.items():
    print(f"{name}: slot load host ms {sorted(ms)}")
from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        load(args.busy_ms)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
if args.out:
    with open(args.out, "w") as f:
        json.dump({"busy_ms": args.busy_ms, "host_ms": rows}, f, indent=1)
