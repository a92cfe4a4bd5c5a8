"""What an engine's start-up leaves of the card for the KV cache: engines of one dummy model with and without
the shrink stage (``lora_stage_slots``), built as now and built the old way (``--old`` arms: the model made
in fp32 and then cast, no cached memory handed back after loading or between the stage's modules, so the
caching allocator carves later tensors out of freed ones and the segments' rest stays reserved). One CUDA
device.

    python benchmarks/scripts/stage_memory.py OUT.json [--model dummy:mistral-7b-v0.3] [--positions 32]
        [--arms new:0 old:0 new:32 old:32 new:auto]

Per arm: KV cache tokens and bytes, stage bytes, the KV bytes lost against the first arm, start-up's peak
allocated bytes, and the allocator's reserved-but-unallocated bytes after start-up. POSITIONS ``auto`` leaves
``lora_stage_slots`` at its default (None: start-up decides, :func:`mmlora.engine.setup._stage_fits`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
from unittest import mock

import torch

import mmlora
import mmlora.engine.setup as setup
import mmlora.lora.stage_build as stage_build


def _old_ways() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for module in (setup, stage_build):
        stack.enter_context(mock.patch.object(module, "release_cached_memory", lambda device: None))
    stack.enter_context(mock.patch.object(setup, "_default_dtype", lambda dtype: contextlib.nullcontext()))
    return stack


def _arm(args: argparse.Namespace, way: str, positions: int | None) -> dict:
    kw = dict(
        model=args.model, dtype="bfloat16", device="cuda", max_loras_per_batch=args.slots,
        max_lora_rank=args.rank, lora_backend="auto", lora_stage_slots=positions,
        # Decode graphs are not timed here, so not captured; auto stages only where they are, so it keeps them.
        disable_cuda_graph=positions is not None,
    )  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    with _old_ways() if way == "old" else contextlib.nullcontext():
        engine = mmlora.Engine(**kw)
    alloc, stage = engine.kv_cache.allocator, engine.runner.lora.stage
    row = {
        "way": way,
        "positions": positions if positions is not None else "auto",
        "stage_positions": stage.capacity if stage is not None else 0,
        "kv_tokens": alloc.num_blocks * alloc.block_size,
        "kv_bytes": engine.kv_cache.data.numel() * engine.kv_cache.data.element_size(),
        "stage_bytes": stage.nbytes() if stage is not None else 0,
        "startup_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "reserved_unallocated_bytes": torch.cuda.memory_reserved() - torch.cuda.memory_allocated(),
    }
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--model", default="dummy:mistral-7b-v0.3")
    p.add_argument("--positions", type=int, default=32)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--arms", nargs="+", default=["old:0", "new:0", "new:32", "old:32"], help="WAY:POSITIONS")
    args = p.parse_args()
    rows = []
    for arm in args.arms:
        way, positions = arm.split(":")
        if way not in ("old", "new"):
            raise SystemExit(f"--arms: {arm!r}: WAY must be old or new")
        rows.append(_arm(args, way, None if positions == "auto" else int(positions)))
        first = rows[0]
        rows[-1]["kv_bytes_lost"] = first["kv_bytes"] - rows[-1]["kv_bytes"]
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "slots": args.slots, "rank": args.rank, "arms": rows}, f, indent=1)


if __name__ == "__main__":
    main()
