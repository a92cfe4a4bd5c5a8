"""Classes chosen by name (LoRA backends, attention backends): register, list, look up with a clear error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class NamedRegistry(Generic[T]):
    """``@registry.register("name")`` on a class sets ``cls.name`` and records it; ``get`` refuses an
    unknown name with the list of the registered ones (``auto`` first, which callers resolve)."""

    def __init__(self, kind: str, option: str) -> None:
        self.kind = kind  # "LoRA backend": in the registered-twice error
        self.option = option  # "lora_backend": the option users set, in the unknown-name error
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def wrap(cls: type[T]) -> type[T]:
            if name in self._classes:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            cls.name = name  # type: ignore[attr-defined]
            self._classes[name] = cls
            return cls

        return wrap

    def names(self) -> list[str]:
        return sorted(self._classes)

    def __contains__(self, name: str) -> bool:
        return name in self._classes

    def get(self, name: str, *, given: str | None = None) -> type[T]:
        """The class registered as ``name`` (``given``: what the user wrote, when it was resolved)."""
        if name not in self._classes:
            raise ValueError(
                f"unknown {self.option} {given or name!r}; registered: auto, {', '.join(self.names())}"
            )
        return self._classes[name]
