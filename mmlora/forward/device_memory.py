"""Device memory housekeeping shared by start-up's steps (weights, adapter slots, the shrink stage)."""

from __future__ import annotations

import torch


def release_cached_memory(device: torch.device) -> None:
    """Give the CUDA caching allocator's free segments back to the device (nothing elsewhere). Between
    start-up's allocations: a block freed and not handed back is carved up by the next allocation, and
    what the caching allocator keeps of its segment is lost to the KV cache, which is sized afterwards
    from the device's free memory."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
