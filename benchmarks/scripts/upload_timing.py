"""Host and GPU time of one adapter upload into a pool slot (``LoRAPool.write_slot`` with its staged
upload plan), per adapter rank, in an unpaged rank-64 pool, one paged by 16, and a pool of the adapter's
own rank, side by side in one process. Also counts the plan's copies: flat pairs (one multi-tensor call)
and strided views (a launch each).

Session 17 (H200, serving): 32 rank-64 Mistral-7B adapters into the default pool paged by 16 took 348 ms of
host and 498 ms of GPU upload time against 83 and 235 ms unpaged, before upload plans split paged A
views by page and joined a module's B views.

Usage: python benchmarks/scripts/upload_timing.py [--model dummy:mistral-7b-v0.3] [--device cuda] OUT.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

import mmlora
from mmlora.bench.adapters import write_random_adapters
from mmlora.lora.adapter import LoadedAdapter
from mmlora.lora.pool import LoRAPool
from mmlora.lora.staging import flatten


def timed_write(pool: LoRAPool, slot: int, adapter: LoadedAdapter) -> tuple[float, float]:
    """(host seconds, GPU seconds: NaN off CUDA) of one ``pool.write_slot(slot, adapter)``."""
    cuda = pool.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    pool.write_slot(slot, adapter)
    host = time.perf_counter() - t0
    if not cuda:
        return host, float("nan")
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) / 1e3


def _time_writes(pool: LoRAPool, uid: int, reps: int) -> dict[str, float]:
    slot = pool.acquire_slot(uid, set())
    adapter = pool.host[uid]
    host, gpu = zip(*(timed_write(pool, slot, adapter) for _ in range(reps)))
    gpu = [g for g in gpu if g == g]  # NaN off CUDA
    host = list(host)
    plan = pool._plans.get((slot, adapter.staged_layout)) if adapter.staged_layout is not None else None
    return {
        "host_ms": sorted(host)[len(host) // 2] * 1e3,
        "gpu_ms": sorted(gpu)[len(gpu) // 2] * 1e3 if gpu else None,
        "flat_copies": len(plan.flat[0]) if plan else None,
        "strided_copies": len(plan.strided[0]) if plan else None,
        "staged": adapter.staged is not None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--model", default="dummy:mistral-7b-v0.3")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    engine = mmlora.Engine(
        model=args.model, device=args.device, dtype=str(dtype).removeprefix("torch."), max_lora_rank=64,
        disable_cuda_graph=True, max_kv_tokens=4096,
    )  # fmt: skip
    lora = engine.lora
    spec = lora._pool.spec
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        made = write_random_adapters(engine.hf_config, tmp, len(args.ranks), args.ranks, dtype=dtype)
        loaded = {m["rank"]: lora._read(m["path"]) for m in made}
        if args.device != "cuda":  # the pool stages (and pins) on CUDA only: stage here to time the plans
            loaded = {rank: flatten(a, pin=False) or a for rank, a in loaded.items()}
        for k in range(args.rounds):
            for rank, adapter in loaded.items():
                for label, max_rank, page in (
                    ("unpaged 64", 64, None),
                    ("paged 64/16", 64, 16),
                    ("own rank", rank, None),
                ):
                    pool = LoRAPool(
                        spec, 4, max_rank, None, dtype, torch.device(args.device), lambda s, r: None,
                        page_rank=page,
                    )  # fmt: skip
                    pool.put_host(1, adapter, set())
                    row = {"round": k, "rank": rank, "pool": label, **_time_writes(pool, 1, args.reps)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    pool.close()
                    del pool
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(
            {"model": args.model, "device": args.device, "date": time.strftime("%F"), "rows": rows},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
