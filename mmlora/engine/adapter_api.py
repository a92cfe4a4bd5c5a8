"""The adapter side of the engine: register (a folder or a hub id), pin, unload once unused, list;
mixed into :class:`~mmlora.engine.engine.Engine`."""

from __future__ import annotations

from typing import Any

from mmlora.hub import hub_root, resolve_adapter


class AdapterAPI:
    """Adapter management for an engine that has ``config``, ``lora`` (its LoRAManager), ``scheduler``
    and the ``_pending_unloads`` it finishes after each step."""

    def load_lora(self, name: str, path: str, pinned: bool = False) -> None:
        """Register an adapter folder, or a hub id ``org/name[@revision]`` (downloaded here, on the caller's
        thread: the server downloads before it hands the engine a folder)."""
        folder = resolve_adapter(
            path,
            download_dir=self.config.model.download_dir,
            allow_pickled=self.config.lora.allow_pickled_adapters,
            what="lora_path",
        )
        self.lora.load(name, folder, pinned=pinned)

    def set_pinned(self, name: str, pinned: bool) -> None:
        """Pin (keep in the host cache and, once loaded, in its device slot) or unpin an adapter."""
        self.lora.set_pinned(name, pinned)

    def unload_lora(self, name: str) -> None:
        """Refuse new requests for ``name`` now; free its slot and host copy once its requests finish."""
        entry = self.lora.begin_unload(name)
        self._pending_unloads.append(entry)
        self._finish_unloads()

    def _finish_unloads(self) -> None:
        for entry in list(self._pending_unloads):
            if entry.refcount == 0:
                self.scheduler.prefix_cache.drop_adapter(entry.uid)
                self.lora.finish_unload(entry)
                self._pending_unloads.remove(entry)

    def list_loras(self) -> list[dict[str, Any]]:
        return [{**a, "root": hub_root(a["path"]) or a["path"]} for a in self.lora.describe()]

    @property
    def lora_backend(self) -> str:
        """The LoRA kernel backend in use (``lora_backend="auto"`` resolved for this device)."""
        return self.lora.backend_name

    @property
    def lora_page_rank(self) -> int | None:
        """Ranks per page of the adapter pool, None when unpaged (``lora_page_rank`` resolved for this
        device)."""
        return self.lora.page_rank
