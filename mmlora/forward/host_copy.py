"""Host tensors of a step's small inputs (token ids, positions, block tables, LoRA routing), built from
Python ints to be copied to the device with ``non_blocking=True``.

``SETTINGS["pinned"]``: for a CUDA device, build them in page-locked memory (PyTorch's caching host
allocator, which keeps a block until the copies that read it have run), so each copy is only queued. From
pageable memory the driver first stages the bytes itself. The suspicion (issue 13): that staging waits for
the adapter uploads in flight on the copy engine and holds the host, since mixed steps' launch time
follows a serving run's uploads: 0.12-0.26 s without, 0.65-0.88 s with 173
(``benchmarks/scripts/upload_launch_probe.py`` tests it on the GPU). Off until measured: behind GPU
compute alone, session 13 found pinned and pageable inputs equally fast.
"""

from __future__ import annotations

from typing import Any

import torch

SETTINGS: dict[str, Any] = {"pinned": False}


def pinned_for(device: torch.device) -> bool:
    """Whether host tensors bound for ``device`` are built page-locked: ``SETTINGS["pinned"]`` and a CUDA
    device (the ``pin_memory`` argument of torch's factories)."""
    return SETTINGS["pinned"] and device.type == "cuda"


def host_tensor(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on the host, page-locked where :func:`pinned_for` says
    (``device``: the copy's destination)."""
    return torch.tensor(values, dtype=dtype, pin_memory=pinned_for(device))


def to_device(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a new tensor on ``device``, copied without waiting (see :func:`host_tensor`)."""
    return host_tensor(values, dtype, device).to(device, non_blocking=True)
