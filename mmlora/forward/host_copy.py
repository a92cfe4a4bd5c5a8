"""Host values onto the GPU without waiting for it: each step's inputs go through pinned memory.

A ``non_blocking`` copy from pageable host memory is asynchronous only in name: the driver may wait for
the stream before it stages the bytes, so the host stops launching until the GPU has caught up. Staged
through pinned memory (torch's caching host allocator, which keeps a block until its copy has run) the copy
is queued like a kernel, and the host goes on building and launching the step while the GPU still runs
the previous one. On CPU these are plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Stage host-to-GPU copies through pinned memory (a switch for A/B measurements).
PINNED = True


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, copied without a host wait on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=PINNED).to(device, non_blocking=True)


def copy_to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; from a host tensor to a CUDA one, without a host wait."""
    if dst.is_cuda and PINNED and src.device.type == "cpu" and not src.is_pinned():
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)
