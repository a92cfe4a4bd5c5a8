"""Process-wide counters a serving breakdown reads per run: Triton compiles, Python's garbage collector
and the CUDA caching allocator's calls to the driver (:mod:`mmlora.bench.breakdown`)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch


class CompileCounter:
    """Counts Triton JIT compiles (all kernels) through Triton's post-compile hook, chaining any other."""

    def __init__(self) -> None:
        self.count = 0
        self.available = False
        self._prev: Callable[..., Any] | None = None
        self._knobs: Any = None

    def install(self) -> None:
        try:
            from triton import knobs
        except ImportError:  # no Triton (or one without knobs): compiles are not counted
            return
        self._knobs = knobs
        self._prev = knobs.runtime.jit_post_compile_hook
        prev = self._prev

        def hook(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return prev(*args, **kwargs) if prev is not None else None

        knobs.runtime.jit_post_compile_hook = hook
        self.available = True

    def uninstall(self) -> None:
        if self._knobs is not None:
            self._knobs.runtime.jit_post_compile_hook = self._prev
            self._knobs = None


class GCTimer:
    """Collections per generation and their seconds, through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.reset()
        self._t0 = 0.0

    def reset(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            gen = info.get("generation", 2)
            self.counts[gen] += 1
            self.seconds[gen] += time.perf_counter() - self._t0

    def install(self) -> None:
        gc.callbacks.append(self)

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def summary(self) -> dict[str, Any]:
        return {"collections": list(self.counts), "seconds": list(self.seconds), "total_s": sum(self.seconds)}


class AllocatorCounter:
    """The CUDA caching allocator's calls to the driver since :meth:`reset` (``torch.cuda.memory_stats``):
    device allocations and frees, allocations retried after the whole cache was freed (each waits for
    every stream), out-of-memory errors. None off CUDA."""

    KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams", "num_ooms")

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.type == "cuda" else None
        self.reset()

    def _stats(self) -> dict[str, Any]:
        return torch.cuda.memory_stats(self.device) if self.device is not None else {}

    def reset(self) -> None:
        self._at_reset = self._stats()

    def summary(self) -> dict[str, int] | None:
        if self.device is None:
            return None
        now = self._stats()
        return {k: int(now.get(k, 0) - self._at_reset.get(k, 0)) for k in self.KEYS}
