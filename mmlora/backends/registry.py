"""Backends are chosen by name; an unknown name is an error that lists the registered ones."""

from __future__ import annotations

from collections.abc import Callable

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


def get_backend(name: str) -> LoRABackend:
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown lora_backend {name!r}; registered backends: {', '.join(available_backends())}"
        )
    return _REGISTRY[name]()
