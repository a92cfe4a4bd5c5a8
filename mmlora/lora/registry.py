"""Adapter registry: user-facing names -> internal ids, with in-flight reference counts.

Ids are never reused, so a name that is unloaded and registered again never aliases old pool state.
Unloading marks the adapter at once (new requests are refused); it is removed when its last
in-flight request releases it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from dataclasses import dataclass


def folder_name_match(key: str, names_and_paths: Iterable[tuple[str, str]]) -> str | None:
    """The name of the one adapter registered by bare path (its name is its path, as in SGLang) whose
    folder is called ``key``; None when there is none, or more than one."""
    if not key or "/" in key or os.sep in key:
        return None
    hits = [n for n, p in names_and_paths if n == p and os.path.basename(os.path.normpath(p)) == key]
    return hits[0] if len(hits) == 1 else None


class UnknownAdapterError(LookupError, ValueError):
    """No such adapter. One rule for unloading: an adapter being unloaded is refused as if it were
    already gone, while requests accepted before the unload finish normally (servers answer 404)."""


@dataclass
class AdapterEntry:
    name: str
    path: str
    uid: int
    pinned: bool = False
    refcount: int = 0
    unloading: bool = False
    rank: int = 0


class AdapterRegistry:
    def __init__(self) -> None:
        self._by_name: dict[str, AdapterEntry] = {}
        self._ids = itertools.count(1)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def entries(self) -> list[AdapterEntry]:
        return list(self._by_name.values())

    def names(self) -> list[str]:
        return list(self._by_name)

    def live_names(self) -> list[str]:
        """Adapters that take requests (those being unloaded are left out)."""
        return [name for name, e in self._by_name.items() if not e.unloading]

    def register(self, name: str, path: str, pinned: bool = False) -> AdapterEntry:
        if not name:
            raise ValueError("lora name must be a non-empty string")
        if name in self._by_name:
            raise ValueError(f"lora name {name!r} is already registered (path {self._by_name[name].path})")
        entry = AdapterEntry(name=name, path=path, uid=next(self._ids), pinned=pinned)
        self._by_name[name] = entry
        return entry

    def get(self, name: str) -> AdapterEntry | None:
        return self._by_name.get(name)

    def lookup(self, name_or_path: str) -> AdapterEntry | None:
        """A registered name, or an already registered path."""
        entry = self._by_name.get(name_or_path)
        if entry is not None:
            return entry
        real = os.path.realpath(name_or_path)
        for e in self._by_name.values():
            if os.path.realpath(e.path) == real:
                return e
        alias = folder_name_match(name_or_path, ((e.name, e.path) for e in self._by_name.values()))
        return self._by_name.get(alias) if alias is not None else None

    def acquire(self, entry: AdapterEntry) -> None:
        if entry.unloading:
            raise UnknownAdapterError(f"lora_path: unknown adapter {entry.name!r} (it is being unloaded)")
        entry.refcount += 1

    def release(self, entry: AdapterEntry) -> None:
        if entry.refcount <= 0:
            raise RuntimeError(f"lora {entry.name!r} released more often than acquired")
        entry.refcount -= 1

    def mark_unloading(self, name: str) -> AdapterEntry:
        entry = self._by_name.get(name)
        if entry is None or entry.unloading:
            raise UnknownAdapterError(
                f"lora {name!r} is not registered; registered: {', '.join(self.live_names()) or 'none'}"
            )
        entry.unloading = True
        return entry

    def remove(self, entry: AdapterEntry) -> None:
        if self._by_name.get(entry.name) is entry:
            del self._by_name[entry.name]
