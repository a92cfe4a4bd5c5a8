"""Backends are chosen by name; an unknown name is an error that lists the registered ones.

``"auto"`` resolves by device: ``triton-auto`` on CUDA (Triton SGMV for prefill, BGMV for decode: both
beat the gather on every distinct / uniform point of the H200 kernel benchmark), ``torch-gather``
elsewhere (Triton off a GPU only runs in its slow interpreter)."""

from __future__ import annotations

import torch

from mmlora.backends.base import LoRABackend
from mmlora.registry import NamedRegistry

_REGISTRY: NamedRegistry[LoRABackend] = NamedRegistry("LoRA backend", "lora_backend")
register_backend = _REGISTRY.register


def available_backends() -> list[str]:
    return _REGISTRY.names()


def resolve_backend_name(name: str, device: torch.device | str | None = None) -> str:
    """``name`` itself, or for ``"auto"`` the backend used on ``device`` (CPU when None)."""
    if name != "auto":
        return name
    on_cuda = device is not None and torch.device(device).type == "cuda"
    return "triton-auto" if on_cuda and "triton-auto" in _REGISTRY else "torch-gather"


def get_backend(name: str, device: torch.device | str | None = None) -> LoRABackend:
    """A new instance of the named backend (``"auto"``: the one for ``device``, see the module doc)."""
    return _REGISTRY.get(resolve_backend_name(name, device), given=name)()
