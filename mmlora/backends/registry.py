"""Backends are chosen by name; an unknown name is an error that lists the registered ones.

``"auto"`` resolves by device: ``triton-auto`` on CUDA (Triton SGMV for prefill, BGMV for decode: both
beat the gather on every distinct / uniform point of the H200 kernel benchmark), ``torch-gather``
elsewhere (Triton off a GPU only runs in its slow interpreter)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmlora.backends.base import LoRABackend

_REGISTRY: dict[str, Callable[[], LoRABackend]] = {}


def register_backend(name: str) -> Callable[[type[LoRABackend]], type[LoRABackend]]:
    def wrap(cls: type[LoRABackend]) -> type[LoRABackend]:
        if name in _REGISTRY:
            raise ValueError(f"LoRA backend {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def resolve_backend_name(name: str, device: torch.device | str | None = None) -> str:
    """``name`` itself, or for ``"auto"`` the backend used on ``device`` (CPU when None)."""
    if name != "auto":
        return name
    on_cuda = device is not None and torch.device(device).type == "cuda"
    return "triton-auto" if on_cuda and "triton-auto" in _REGISTRY else "torch-gather"


def get_backend(name: str, device: torch.device | str | None = None) -> LoRABackend:
    """A new instance of the named backend (``"auto"``: the one for ``device``, see the module doc)."""
    resolved = resolve_backend_name(name, device)
    if resolved not in _REGISTRY:
        raise ValueError(
            f"unknown lora_backend {name!r}; registered backends: auto, {', '.join(available_backends())}"
        )
    return _REGISTRY[resolved]()
