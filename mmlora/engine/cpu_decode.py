"""CPU facts the engine chooses by: whether the CPU computes bf16 natively, and so what ``dtype="auto"``
means on CPU.

A CPU decode step is bound by reading the weights (see ``python -m mmlora.bench cpu``); bf16 halves those
bytes, but only pays where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX-BF16). Elsewhere torch
converts bf16 to fp32 in software and a step gets slower, so ``auto`` keeps fp32 there.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

#: /proc/cpuinfo flags that mean native bf16 dot products.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The :data:`BF16_FLAGS` this CPU reports (empty where /proc/cpuinfo is missing: not Linux)."""
    path = Path(cpuinfo)
    if not path.is_file():
        return frozenset()
    for line in path.read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(BF16_FLAGS) & frozenset(line.split(":", 1)[1].split())
    return frozenset()


def auto_cpu_dtype() -> torch.dtype:
    """``dtype="auto"`` on CPU: bfloat16 where the CPU has native bf16 (:data:`BF16_FLAGS`), else float32."""
    return torch.bfloat16 if cpu_bf16_flags() else torch.float32
