"""Where one adapter upload's host time goes (issue 13: 8-11 ms per Mistral-7B rank-16 upload on the H200,
with the GPU waiting on the host). Builds an engine with N random adapters loaded into the host cache, then
writes them into a slot one by one: host and GPU time of each ``write_slot`` (median), and a
torch.profiler table of one upload (CPU and CUDA activities), top ops by self CPU time.

    PYTHONPATH=. python benchmarks/scripts/upload_profile.py [--model dummy:mistral-7b-v0.3] [--num 8]
"""

import argparse
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile
from upload_timing import timed_write  # this folder's script, on sys.path as the script's own

import mmlora
from mmlora.bench.adapters import write_random_adapters

p = argparse.ArgumentParser()
p.add_argument("--model", default="dummy:mistral-7b-v0.3")
p.add_argument("--num", type=int, default=8)
p.add_argument("--rank", type=int, default=16)
p.add_argument("--device", default="auto")
args = p.parse_args()
folder = tempfile.mkdtemp()
made = write_random_adapters(args.model.removeprefix("dummy:"), folder, args.num, [args.rank])
engine = mmlora.Engine(
    model=args.model, device=args.device, lora_paths={m["name"]: m["path"] for m in made},
    max_loras_per_batch=2, max_lora_rank=args.rank, max_running_requests=8, max_model_len=1024,
    disable_cuda_graph=True,
)  # fmt: skip
pool = engine.lora._pool  # a benchmark instrument: the pool's slot writes are the uploads
cuda = engine.device.type == "cuda"
adapters = list(pool.host.values())
print(
    f"{len(adapters)} adapters in the host cache; staged: {[a.staged is not None for a in adapters][:3]}..."
)


def upload(adapter, slot: int = 0) -> tuple[float, float]:  # noqa: ANN001
    return timed_write(pool, slot, adapter)


if cuda:
    staged = adapters[0].staged or ()
    print(f"staged blocks: {len(staged)}, all page-locked: {all(b.is_pinned() for b in staged)}")
    # The link itself: one 84 MB-class copy from page-locked and from pageable host memory, and the same
    # bytes in 16 MB blocks, so an upload's GPU time can be set against what the bus gives.
    nbytes = sum(b.numel() * b.element_size() for b in staged) or 84 << 20
    dst = torch.empty(nbytes, dtype=torch.uint8, device=engine.device)
    for label, src in (
        ("page-locked", torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)),
        ("pageable", torch.empty(nbytes, dtype=torch.uint8)),
    ):
        for blocks in (1, max(1, nbytes // (16 << 20))):
            parts = list(zip(src.chunk(blocks), dst.chunk(blocks)))
            best = float("inf")
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for s_, d_ in parts:
                    d_.copy_(s_, non_blocking=True)
                host_s = time.perf_counter() - t0
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            print(
                f"H2D {label:11s} {nbytes / 1e6:.0f} MB in {len(parts)} copies: {best * 1e3:.2f} ms "
                f"({nbytes / best / 1e9:.1f} GB/s), host {host_s * 1e3:.2f} ms of the last"
            )

# The first write into each slot (session 8 builds every slot's upload plan when a layout's first adapter
# is loaded, so this should cost what a repeated write does).
firsts = [upload(adapters[s], s) for s in range(min(pool.num_slots, len(adapters)))]
print("first write into each slot: host " + ", ".join(f"{t * 1e3:.2f}" for t, _ in firsts) + " ms")
for a in adapters:  # warm-up
    upload(a)
times = [upload(a) for a in adapters for _ in range(2)]
host = statistics.median(t for t, _ in times)
gpu = statistics.median(g for _, g in times)
print(f"write_slot: host {host * 1e3:.2f} ms, GPU {gpu * 1e3:.2f} ms (median of {len(times)})")
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
with profile(activities=activities) as prof:
    upload(adapters[0])
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
