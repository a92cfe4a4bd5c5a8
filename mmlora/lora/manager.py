"""LoRAManager: the one entry point to adapters. It owns the registry (names, ids, refcounts), the pool
(host cache, device slots), the per-forward LoRABatchInfo and the model's LoRALinear wrappers.

The engine and scheduler call ``resolve`` (a request's adapter, once, at add_request), ``acquire`` /
``release`` (the request's reference), ``can_admit`` / ``admit`` (a device slot), and ``activate`` (eager
forwards) or ``prepare_capture`` / ``prepare_replay`` (CUDA-graph forwards, the buffers being ours; these
per-forward methods: :mod:`mmlora.lora.routing`). How requests name adapters: :mod:`mmlora.lora.refs`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from torch import nn

from mmlora.backends import get_backend
from mmlora.backends.warmup import warm_up_lora_kernels
from mmlora.config import LoRAConfig, split_lora_spec
from mmlora.distributed.state import tp_group
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights
from mmlora.lora.adapter import LoadedAdapter, load_adapter
from mmlora.lora.layer import LoRAContext, LoRALinear
from mmlora.lora.pages import resolve_page_rank
from mmlora.lora.paths import confine_adapter_path
from mmlora.lora.pool import LoRAPool
from mmlora.lora.refs import AdapterRef, UnknownAdapterError
from mmlora.lora.registry import AdapterEntry, AdapterRegistry
from mmlora.lora.routing import ForwardRouting
from mmlora.lora.shard import AdapterSharder, ShardedLoRAPool, recv_shard
from mmlora.lora.spec import LoRATargetModel
from mmlora.lora.stage import ShrinkStage
from mmlora.lora.stage_build import StageShape, build_stage

logger = logging.getLogger(__name__)


def _target(model: LoRATargetModel, layer: int, target: str) -> nn.Module:
    return model.layers[layer].get_submodule(model.lora_target_paths[target])


def _slot_hook(info: LoRABatchInfo, ctx: LoRAContext) -> Callable[[int, int], None]:
    """The pool's ``on_slot_change``: a slot written or emptied has a new rank for the routing, and its
    staged shrink (if any) is stale. Not a method: the pool would then hold the manager, whose drop
    must free the pool without the garbage collector."""

    def changed(slot: int, rank: int) -> None:
        info.set_slot_rank(slot, rank)
        if ctx.stage is not None:
            ctx.stage.set_rank(slot, rank)

    return changed


class LoRAManager(ForwardRouting):
    def __init__(
        self,
        model: LoRATargetModel,
        config: LoRAConfig,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        stage_fits: Callable[[int], bool] | None = None,
    ) -> None:
        """``stage_fits(nbytes)``: whether a shrink stage of that many bytes may be taken from the KV cache,
        asked when ``lora_stage_slots`` is None (auto; without it, auto leaves the stage off)."""
        self.config = config
        self.spec = model.lora_model_spec()  # full sizes: adapters are validated against these
        #: Ranks per page of the pool, None when unpaged (``lora_page_rank`` resolved for the device).
        self.page_rank = resolve_page_rank(config.lora_page_rank, config.max_lora_rank, device)
        slot_ids = LoRAPool.page_count(config.max_loras_per_batch, config.max_lora_rank, self.page_rank)
        self.info = LoRABatchInfo(max_tokens, slot_ids, device, config.max_lora_rank)
        # The pool holds this tensor-parallel rank's shards (everything at tp_size 1).
        pool_args = (
            model.lora_model_spec(full=False),
            config.max_loras_per_batch,
            config.max_lora_rank,
            config.max_loaded_loras,
            dtype,
            device,
        )
        self._ctx = LoRAContext(
            backend=get_backend(config.lora_backend, device),
            fuse_base=config.cpu_fused_lora and device.type == "cpu",
        )
        slot_ranks = _slot_hook(self.info, self._ctx)
        if tp_group().is_parallel and tp_group().rank == 0:
            sharder = AdapterSharder({t.name: _target(model, 0, t.name) for t in self.spec.targets})
            self._pool = ShardedLoRAPool(
                sharder, *pool_args, on_slot_change=slot_ranks, page_rank=self.page_rank
            )
        else:
            self._pool = LoRAPool(*pool_args, on_slot_change=slot_ranks, page_rank=self.page_rank)
        self._offsets = {t.name: t.slice_offsets for t in self._pool.spec.targets}
        # One device (a sharded pool's writes are collectives, kept in step): slot loads beside the forwards.
        if device.type == "cuda" and not tp_group().is_parallel and not config.disable_async_uploads:
            self._pool.upload_stream = torch.cuda.Stream(device)
        if device.type == "cuda" and not config.disable_lora_overlap:
            self._ctx.side_stream = torch.cuda.Stream(device)
            self._ctx.side_max_tokens = config.lora_side_max_tokens
        self._registry = AdapterRegistry()
        self.dtype = dtype
        self._wrap(model)
        self._ctx.stage = build_stage(
            [w for _, _, w in self._wrapped],
            config.lora_stage_slots,
            StageShape(slot_ids, self.page_rank, self._pool.pages),
            self._ctx.backend,
            device,
            stage_fits,
        )
        for spec in config.lora_paths:
            name, path = split_lora_spec(spec)
            self.load(name, path)

    def _wrap(self, model: LoRATargetModel) -> None:
        self._wrapped: list[tuple[nn.Module, str, LoRALinear]] = []  # (parent, attribute, wrapper)
        for i, layer in enumerate(model.layers):
            for target in self._pool.spec.targets:
                parent_path, attr = model.lora_target_paths[target.name].rsplit(".", 1)
                parent = layer.get_submodule(parent_path)
                A, B, scalings = self._pool.buffers[(i, target.name)]
                weights = LoRAWeights(A, B, scalings, target.slice_offsets)
                wrapper = LoRALinear(getattr(parent, attr), weights, self._ctx)
                setattr(parent, attr, wrapper)
                self._wrapped.append((parent, attr, wrapper))

    @property
    def stage(self) -> ShrinkStage | None:
        """The staged shrinks (``lora_stage_slots``), None when off."""
        return self._ctx.stage

    def close(self) -> None:
        """Free the adapter slots: the model gets its base linears back (the wrappers hold views of the
        slot buffers), then the pool drops the buffers and its host cache."""
        for parent, attr, wrapper in self._wrapped:
            setattr(parent, attr, wrapper.base)
        self._wrapped.clear()
        self._pool.close()

    def warm_up_kernels(self) -> int:
        """Compile the backend's kernel variants now (see :mod:`mmlora.backends.warmup`); returns calls."""
        weights = (
            LoRAWeights(A, B, sc, self._offsets[target])
            for (_, target), (A, B, sc) in self._pool.buffers.items()
        )
        return warm_up_lora_kernels(self._ctx.backend, weights, self.info.max_tokens)

    # ---- a tensor-parallel worker's slots (rank 0 sends them; see mmlora.lora.shard) -------------

    def receive_slot(self, slot: int, adapter_rank: int) -> None:
        """Receive this worker's shard of the adapter rank 0 writes into ``slot``, and write it."""
        pool = self._pool
        pool.write_slot(slot, recv_shard(pool.spec, pool.dtype, pool.device, adapter_rank))

    def clear_slot(self, slot: int) -> None:
        self._pool.clear_slot(slot)

    # ---- what the engine reports ----------------------------------------------------------------

    @property
    def backend_name(self) -> str:
        return self._ctx.backend.name

    @property
    def mixed_graphs(self) -> bool:
        """Whether CUDA graphs may hold the backend's launches for prefill and mixed steps
        (``LoRABackend.mixed_graphs``)."""
        return self._ctx.backend.mixed_graphs

    @property
    def num_slots(self) -> int:
        """Adapters of max_lora_rank the pool holds (max_loras_per_batch; smaller ranks take fewer pages of
        a paged pool, so more of them fit)."""
        return self._pool.max_adapters

    @property
    def slots_used(self) -> int:
        return self._pool.slots_used

    @property
    def pool_generation(self) -> int:
        """Moves with every write into the adapter slots (a load, an eviction, a slot zeroed)."""
        return self._pool.generation

    @property
    def slot_loads(self) -> int:
        """Adapter loads into device slots since start (adapter churn)."""
        return self._pool.slot_loads

    def nbytes(self) -> int:
        return self._pool.nbytes()

    def stage_nbytes(self) -> int:
        """GPU memory of the shrink stage's positions (:meth:`ShrinkStage.nbytes`), 0 when off."""
        return self._ctx.stage.nbytes() if self._ctx.stage is not None else 0

    def slot_padding_fraction(self, entries: list[AdapterEntry] | None = None) -> float:
        """Share of the slot memory of ``entries`` (default: every adapter in a slot) that is padding;
        entries without a slot are left out (see LoRAPool.slot_padding_fraction)."""
        if entries is None:
            return self._pool.slot_padding_fraction()
        slots = [self._pool.slot_of(e.uid) for e in entries]
        return self._pool.slot_padding_fraction(s for s in slots if s is not None)

    def entry(self, name: str) -> AdapterEntry | None:
        return self._registry.get(name)

    def slot_of(self, entry: AdapterEntry) -> int | None:
        return self._pool.slot_of(entry.uid)

    def describe(self) -> list[dict[str, object]]:
        """One dict per registered adapter (what ``Engine.list_loras`` answers)."""
        return [
            {
                "name": e.name,
                "path": e.path,
                "rank": e.rank,
                "pinned": e.pinned,
                "in_gpu_slot": self._pool.slot_of(e.uid) is not None,
                "in_host_cache": self._pool.in_host(e.uid),
                "active_requests": e.refcount,
                "unloading": e.unloading,
            }
            for e in self._registry.entries()
        ]

    # ---- adapters -------------------------------------------------------------------------------

    def _read(self, path: str) -> LoadedAdapter:
        return load_adapter(
            path,
            self.spec,
            max_lora_rank=self.config.max_lora_rank,
            allow_pickled=self.config.allow_pickled_adapters,
            dtype=self.dtype,
        )

    def _check_can_pin(self, name: str) -> None:
        # At least one slot must stay free of pins, or unpinned adapters could never be served.
        if len(self._pool.pinned) + 1 >= self._pool.max_adapters:
            raise ValueError(
                f"cannot pin {name!r}: at most max_loras_per_batch - 1 = {self._pool.max_adapters - 1} adapters may be pinned"
            )

    def load(self, name: str, path: str, pinned: bool = False) -> AdapterEntry:
        """Validate fully, then register, cache on the host and, where free device pages allow, load into
        a slot (:meth:`_fill_free_slot`). Errors leave every state unchanged."""
        if name in self._registry:
            raise ValueError(f"lora name {name!r} is already registered")
        if pinned:
            self._check_can_pin(name)
        adapter = self._read(path)
        entry = self._registry.register(name, path)
        entry.rank = adapter.rank
        self._pool.put_host(entry.uid, adapter, self._protected())
        if pinned:
            self.set_pinned(name, True)
        self._fill_free_slot(entry)
        logger.info("loaded adapter %s (rank %d) from %s", name, adapter.rank, path)
        return entry

    def _fill_free_slot(self, entry: AdapterEntry) -> None:
        """Load a newly registered adapter into device pages no adapter holds, where there are enough
        (never evicting one), so its first request finds it resident instead of waiting for its upload.
        Beside the forwards where loads are asynchronous. At tp_size 1 only: a sharded pool sends each
        slot write to the workers, and that path is exercised by admissions alone."""
        if tp_group().is_parallel:
            return
        self._pool.acquire_slot(entry.uid, busy=self._pool.resident())  # all busy: free pages or nothing

    def set_pinned(self, name: str, pinned: bool) -> None:
        """A pinned adapter is never evicted from the host cache nor, once loaded, from its device slot."""
        entry = self._registry.get(name)
        if entry is None or entry.unloading:
            raise ValueError(
                f"unknown adapter {name!r}; registered: {', '.join(self._registry.names()) or 'none'}"
            )
        if pinned and not entry.pinned:
            self._check_can_pin(name)
        entry.pinned = pinned
        if pinned:
            self._pool.pinned.add(entry.uid)
        else:
            self._pool.pinned.discard(entry.uid)

    def resolve(self, lora: str | AdapterRef | None) -> AdapterEntry | None:
        """None (base) or the adapter ``lora`` names (see :class:`AdapterRef`); a folder is registered
        under its own path on first use. Raises :class:`UnknownAdapterError` or ValueError."""
        if lora is None:
            return None
        ref = lora if isinstance(lora, AdapterRef) else AdapterRef(lora)
        entry = self._resolve_key(ref, ref.key, ref.param)
        if ref.same_as is not None:
            param, key = ref.same_as
            if self._resolve_key(ref, key, param) is not entry:
                raise ValueError(f"{ref.param}: {param} and {ref.param} name different adapters")
        return entry

    def _resolve_key(self, ref: AdapterRef, key: str, param: str) -> AdapterEntry:
        if not isinstance(key, str) or not key:
            raise ValueError(f"{param}: expected a name, a path or None, got {key!r}")
        path = key
        entry = self._registry.lookup(key)
        if entry is None and ref.allow_folders and (not ref.confine or "/" in key or os.sep in key):
            if ref.confine:
                path = confine_adapter_path(key, ref.lora_root, param=param)
                entry = self._registry.lookup(path)
            if entry is None and os.path.isdir(path):
                return self.load(path, path)
        if entry is None:
            raise UnknownAdapterError(param, key, self.names())
        if entry.unloading:
            raise UnknownAdapterError(param, entry.name, self.names(), reason="it is being unloaded")
        return entry

    def names(self) -> list[str]:
        """Adapters that take requests (those being unloaded are left out)."""
        return [e.name for e in self._registry.entries() if not e.unloading]

    def acquire(self, entry: AdapterEntry) -> None:
        """A request holds ``entry`` (unload waits for every holder to release it)."""
        self._registry.acquire(entry)

    def release(self, entry: AdapterEntry) -> None:
        self._registry.release(entry)

    def _protected(self) -> set[int]:
        return {e.uid for e in self._registry.entries() if e.refcount > 0}

    def begin_unload(self, name: str) -> AdapterEntry:
        """Refuse new requests for ``name``; :meth:`finish_unload` once its refcount reaches zero."""
        return self._registry.mark_unloading(name)

    def finish_unload(self, entry: AdapterEntry) -> None:
        self._pool.drop(entry.uid)
        self._registry.remove(entry)
        logger.info("unloaded adapter %s", entry.name)

    # ---- admission ------------------------------------------------------------------------------

    def can_admit(self, entry: AdapterEntry, busy: set[int]) -> bool:
        """Whether ``entry`` has, or can take without evicting an adapter in ``busy``, a device slot."""
        return self._pool.can_get_slot(entry.uid, busy, entry.rank or None)

    def admit(self, entry: AdapterEntry, busy: set[int]) -> int | None:
        """Bring ``entry`` into the host cache (re-validated from disk if it was evicted: a ValueError if
        its files changed) and a device slot; returns the slot, or None while its load into the slot
        still runs beside the forwards (:attr:`loads_async`: ask again next step). Call after
        ``can_admit``."""
        if self._pool.in_host(entry.uid):
            self._pool.touch_host(entry.uid)
        else:
            self._pool.put_host(entry.uid, self._read(entry.path), self._protected())
        slot = self._pool.acquire_slot(entry.uid, busy)
        if slot is None:
            raise RuntimeError(f"admit: no device slot for {entry.name!r} (can_admit was not asked)")
        return slot if self._pool.slot_ready(slot) else None

    @property
    def loads_async(self) -> bool:
        """Whether slot loads run beside the forwards (CUDA, one device, not disabled)."""
        return self._pool.upload_stream is not None

    def prefetch(self, entry: AdapterEntry, keep: set[int]) -> None:
        """Start loading ``entry`` into a slot ahead of its request's admission (S-LoRA's prefetch), when a
        slot is free or holds an adapter outside ``keep``; nothing if it is resident or loading already,
        or if its files cannot be read now (its admission reports that)."""
        if not self.loads_async or self._pool.slot_of(entry.uid) is not None:
            return
        if not self._pool.can_get_slot(entry.uid, keep, entry.rank or None):
            return
        try:
            self.admit(entry, keep)
        except ValueError:
            return
