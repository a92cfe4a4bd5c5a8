"""Which adapter a request names, and where run-time adapters may be read from.

A request names an adapter by its registered name, by the path it was registered with, or (OpenAI
``model``) as ``<served-name>:<adapter>``. Run-time paths are confined to ``--lora-root`` by
:func:`mmlora.lora.paths.confine_adapter_path`.
"""

from __future__ import annotations

import os
from typing import Any

from mmlora.engine.background import BackgroundEngine
from mmlora.lora.paths import AdapterFolderMissing, AdapterPathError
from mmlora.lora.paths import confine_adapter_path as confine
from mmlora.server.config import ServerConfig
from mmlora.server.errors import APIError


def confine_adapter_path(path: str, lora_root: str | None, *, param: str = "lora_path") -> str:
    """The real path of an adapter folder inside ``lora_root``, or ``APIError`` naming the problem: 404
    for a folder that does not exist there, 400 for a path that may not be read."""
    try:
        return confine(path, lora_root, param=param)
    except AdapterFolderMissing as e:
        raise APIError(404, str(e), param=param, code="lora_not_found") from None
    except AdapterPathError as e:
        raise APIError(400, str(e), param=param) from None


class AdapterDirectory:
    """A cached view of the engine's adapter registry, for resolving names without a round trip."""

    def __init__(self, bg: BackgroundEngine, served_name: str, config: ServerConfig) -> None:
        self.bg = bg
        self.served_name = served_name
        self.config = config
        self._loras: list[dict[str, Any]] = []

    async def refresh(self) -> list[dict[str, Any]]:
        self._loras = await self.bg.run_async(lambda eng: list(eng.list_loras()))
        return self._loras

    @property
    def loras(self) -> list[dict[str, Any]]:
        return self._loras

    def _live(self) -> list[dict[str, Any]]:
        return [info for info in self._loras if not info.get("unloading")]

    def _lookup(self, key: str) -> str | None:
        for info in self._live():
            if info["name"] == key:
                return info["name"]
        real = os.path.realpath(key) if ("/" in key or os.sep in key) else None
        for info in self._live():
            path = info.get("path")
            if path and (path == key or (real is not None and os.path.realpath(path) == real)):
                return info["name"]
        return None

    async def resolve(self, key: str | None, *, param: str = "lora_path") -> str | None:
        """An adapter's name (or a path) -> the name to give the engine; None/"" -> base model."""
        if key is None or key == "":
            return None
        if not isinstance(key, str):
            raise APIError(400, f"{param}: expected a string or null, got {type(key).__name__}", param=param)
        found = self._lookup(key)
        if found is None:
            await self.refresh()
            found = self._lookup(key)
        if found is not None:
            return found
        if self.config.enable_lora_runtime_update and ("/" in key or os.sep in key):
            # An unregistered path under the adapter root: the engine registers and loads it on first use.
            return confine_adapter_path(key, self.config.lora_root, param=param)
        raise APIError(
            404,
            f"{param}: unknown adapter {key!r}; loaded: {self.names()}",
            param=param,
            code="lora_not_found",
        )

    async def resolve_model(self, model: str | None) -> str | None:
        """OpenAI ``model`` -> adapter name or None for the base: served name, adapter, or served:adapter."""
        if model is None or model == "" or model == self.served_name:
            return None
        prefix = self.served_name + ":"
        key = model[len(prefix) :] if model.startswith(prefix) else model
        try:
            return await self.resolve(key, param="model")
        except APIError as e:
            if e.status != 404:
                raise
            raise APIError(
                404,
                f"model {model!r} not found; available: {[self.served_name, *self.names()]}",
                param="model",
                code="model_not_found",
            ) from None

    def names(self) -> list[str]:
        """Adapters that take requests (those being unloaded are left out)."""
        return [info["name"] for info in self._live()]

    def live(self) -> list[dict[str, Any]]:
        return self._live()
