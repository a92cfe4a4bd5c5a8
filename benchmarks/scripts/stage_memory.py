"""What the shrink stage (``lora_stage_slots``) costs the KV cache, against its own bytes: engines of one
dummy model with no stage, with the stage, and with the stage built without handing each replaced base
weight's memory back (``mmlora.lora.manager.release_cached_memory`` a no-op: the allocator then carves later
W_cat out of freed weights, and the segments' rest stays reserved). One CUDA device.

    python benchmarks/scripts/stage_memory.py OUT.json [--model dummy:mistral-7b-v0.3] [--positions 32]

Per arm: KV cache tokens, stage bytes, the KV bytes lost against the no-stage engine, and the allocator's
reserved-but-unallocated bytes after start-up (``memory_reserved - memory_allocated``).
"""

from __future__ import annotations

import argparse
import gc
import json
from unittest import mock

import torch

import mmlora
import mmlora.lora.manager as manager


def _arm(model: str, positions: int, release: bool, slots: int, rank: int, device: str) -> dict:
    kw = dict(
        model=model, dtype="bfloat16", device=device, max_loras_per_batch=slots, max_lora_rank=rank,
        lora_backend="auto", lora_stage_slots=positions, disable_cuda_graph=True,
    )  # fmt: skip
    keep = manager.release_cached_memory if release else (lambda device: None)
    with mock.patch.object(manager, "release_cached_memory", keep):
        engine = mmlora.Engine(**kw)
    alloc = engine.kv_cache.allocator
    stage = engine.runner.lora.stage
    row = {
        "positions": positions,
        "release": release,
        "kv_tokens": alloc.num_blocks * alloc.block_size,
        "kv_bytes": engine.kv_cache.data.numel() * engine.kv_cache.data.element_size(),
        "stage_bytes": stage.nbytes() if stage is not None else 0,
    }
    if device == "cuda":
        row["reserved_unallocated_bytes"] = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        row["inactive_split_bytes"] = torch.cuda.memory_stats().get("inactive_split_bytes.all.current", 0)
    engine.close()
    del engine
    gc.collect()
    manager.release_cached_memory(torch.device(device))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--model", default="dummy:mistral-7b-v0.3")
    p.add_argument("--positions", type=int, default=32)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (no allocator to fragment)")
    args = p.parse_args()
    rows = [_arm(args.model, 0, True, args.slots, args.rank, args.device)]
    rows += [
        _arm(args.model, args.positions, release, args.slots, args.rank, args.device)
        for release in (True, False)
    ]
    base = rows[0]["kv_tokens"]
    for r in rows:
        r["kv_tokens_lost"] = base - r["kv_tokens"]
        r["kv_bytes_lost"] = rows[0]["kv_bytes"] - r["kv_bytes"]
        r["kv_bytes_lost_over_stage_bytes"] = (
            r["kv_bytes_lost"] / r["stage_bytes"] if r["stage_bytes"] else None
        )
        print(json.dumps(r))
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "slots": args.slots, "rank": args.rank, "arms": rows}, f, indent=1)


if __name__ == "__main__":
    main()
