"""LoRAManager: ties the registry, the host cache / device slots and the model's LoRALinear wrappers."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

from mmlora.backends import get_backend
from mmlora.config import LoRAConfig, split_lora_spec
from mmlora.lora.adapter import load_adapter
from mmlora.lora.batch_info import LoRABatchInfo
from mmlora.lora.layer import LoRAContext, LoRALinear
from mmlora.lora.pool import LoRAPool
from mmlora.lora.registry import AdapterEntry, AdapterRegistry, UnknownAdapterError
from mmlora.models.base import CausalLM

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self, model: CausalLM, config: LoRAConfig, max_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.config = config
        self.spec = model.lora_model_spec()
        self.info = LoRABatchInfo(max_tokens, config.max_loras_per_batch, device)
        self.pool = LoRAPool(
            self.spec,
            config.max_loras_per_batch,
            config.max_lora_rank,
            config.max_loaded_loras,
            dtype,
            device,
            on_slot_change=self.info.set_slot_rank,
        )
        self.ctx = LoRAContext(backend=get_backend(config.lora_backend, device))
        self.registry = AdapterRegistry()
        self.dtype = dtype
        self._wrap(model)
        for spec in config.lora_paths:
            name, path = split_lora_spec(spec)
            self.load(name, path)

    def _wrap(self, model: CausalLM) -> None:
        for i, layer in enumerate(model.layers):
            for target in self.spec.targets:
                parent_path, attr = model.lora_target_paths[target.name].rsplit(".", 1)
                parent = layer.get_submodule(parent_path)
                A, B, scalings = self.pool.buffers[(i, target.name)]
                wrapper = LoRALinear(getattr(parent, attr), A, B, scalings, target.slice_offsets, self.ctx)
                setattr(parent, attr, wrapper)

    # ---- adapters -------------------------------------------------------------------------------

    def _read(self, path: str):
        return load_adapter(
            path,
            self.spec,
            max_lora_rank=self.config.max_lora_rank,
            allow_pickled=self.config.allow_pickled_adapters,
            dtype=self.dtype,
        )

    def _check_can_pin(self, name: str) -> None:
        # At least one slot must stay free of pins, or unpinned adapters could never be served.
        if len(self.pool.pinned) + 1 >= self.pool.num_slots:
            raise ValueError(
                f"cannot pin {name!r}: at most max_loras_per_batch - 1 = {self.pool.num_slots - 1} adapters may be pinned"
            )

    def load(self, name: str, path: str, pinned: bool = False) -> AdapterEntry:
        """Validate fully, then register and cache on the host. Errors leave every state unchanged."""
        if name in self.registry:
            raise ValueError(f"lora name {name!r} is already registered")
        if pinned:
            self._check_can_pin(name)
        adapter = self._read(path)
        entry = self.registry.register(name, path)
        entry.rank = adapter.rank
        self.pool.put_host(entry.uid, adapter, self._protected())
        if pinned:
            self.set_pinned(name, True)
        logger.info("loaded adapter %s (rank %d) from %s", name, adapter.rank, path)
        return entry

    def set_pinned(self, name: str, pinned: bool) -> None:
        """A pinned adapter is never evicted from the host cache nor, once loaded, from its device slot."""
        entry = self.registry.get(name)
        if entry is None or entry.unloading:
            raise ValueError(
                f"unknown adapter {name!r}; registered: {', '.join(self.registry.names()) or 'none'}"
            )
        if pinned and not entry.pinned:
            self._check_can_pin(name)
        entry.pinned = pinned
        if pinned:
            self.pool.pinned.add(entry.uid)
        else:
            self.pool.pinned.discard(entry.uid)

    def resolve(self, lora: str | None) -> AdapterEntry | None:
        """None (base), a registered name, or a path (registered under its own path on first use)."""
        if lora is None:
            return None
        if not isinstance(lora, str) or not lora:
            raise ValueError(f"lora_path: expected a name, a path or None, got {lora!r}")
        entry = self.registry.lookup(lora)
        if entry is not None:
            if entry.unloading:
                raise UnknownAdapterError(f"lora_path: unknown adapter {entry.name!r} (it is being unloaded)")
            return entry
        if os.path.isdir(lora):
            return self.load(lora, lora)
        known = ", ".join(self.registry.live_names()) or "none"
        raise UnknownAdapterError(
            f"lora_path: unknown adapter {lora!r} (not a registered name nor a folder); registered: {known}"
        )

    def ensure_host(self, entry: AdapterEntry) -> None:
        """Bring an adapter back into the host cache if it was evicted (re-validated from disk)."""
        if self.pool.in_host(entry.uid):
            self.pool.touch_host(entry.uid)
        else:
            self.pool.put_host(entry.uid, self._read(entry.path), self._protected())

    def _protected(self) -> set[int]:
        return {e.uid for e in self.registry.entries() if e.refcount > 0}

    def finish_unload(self, entry: AdapterEntry) -> None:
        self.pool.drop(entry.uid)
        self.registry.remove(entry)
        logger.info("unloaded adapter %s", entry.name)

    # ---- per forward ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def activate(self, seq_lens: list[int], seq_slots: list[int]) -> Iterator[LoRABatchInfo]:
        if self.ctx.info is not None:
            raise RuntimeError("nested LoRA forwards are not allowed")
        self.info.fill(seq_lens, seq_slots)
        self.ctx.info = self.info
        try:
            yield self.info
        finally:
            self.ctx.info = None
