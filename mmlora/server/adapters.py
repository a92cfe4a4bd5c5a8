"""Which adapter a request names, and where run-time adapters may be read from.

A request names an adapter by its registered name, by the path it was registered with, or (OpenAI
``model``) as ``<served-name>:<adapter>``. Run-time paths are confined to ``--lora-root`` by their
resolved real path, so ``..``, absolute paths elsewhere and symbolic links that point outside are all
refused before the engine reads a byte; only safetensors adapters are accepted.
"""

from __future__ import annotations

import os
from typing import Any

from mmlora.engine.background import BackgroundEngine
from mmlora.server.config import ServerConfig
from mmlora.server.errors import APIError

_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def confine_adapter_path(path: str, lora_root: str | None, *, param: str = "lora_path") -> str:
    """Return the real path of a PEFT adapter folder inside ``lora_root``, or raise ``APIError(400)``."""
    if not lora_root:
        raise APIError(400, "adapters cannot be loaded by path: the server has no --lora-root", param=param)
    if "\x00" in path:
        raise APIError(400, "lora_path: contains a NUL byte", param=param)
    root = os.path.realpath(lora_root)
    real = os.path.realpath(os.path.join(root, path))  # an absolute `path` replaces root here
    if not _inside(real, root):
        raise APIError(400, f"{param}: {path!r} is outside the allowed adapter root", param=param)
    if not os.path.isdir(real):
        raise APIError(400, f"{param}: {path!r} is not an adapter folder under the adapter root", param=param)
    for name in _ADAPTER_FILES:
        file = os.path.join(real, name)
        if not os.path.exists(file):
            if name.endswith(".safetensors") and any(
                os.path.exists(os.path.join(real, b)) for b in ("adapter_model.bin", "pytorch_model.bin")
            ):
                raise APIError(
                    400,
                    f"{param}: pickled adapters (.bin) are refused; convert it to safetensors",
                    param=param,
                )
            raise APIError(400, f"{param}: {path!r} has no {name}", param=param)
        if not _inside(os.path.realpath(file), root):
            raise APIError(400, f"{param}: {name} links outside the allowed adapter root", param=param)
    return real


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
