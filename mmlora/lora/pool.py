"""Adapter memory pool: ``max_loras_per_batch`` device slots sized by ``max_lora_rank``, and a host cache.

Device side: per (layer, target) one A [S, n*R, in], B [S, out, R] and scalings [S, n] buffer; an
adapter occupies the same slot index in all of them. Slots are reused least-recently-used first, never
one whose adapter is in the running batch (``busy``) and never a pinned one. Paged (``page_rank``): the
same memory in pages of ``page_rank`` ranks, an adapter taking the pages its rank needs
(:mod:`mmlora.lora.pages`), its slot being its first page. Host side: up to
``max_loaded_loras`` validated adapters (LRU), never evicting a pinned adapter or one with requests
in flight; an evicted adapter is read from disk again on its next use.

On CUDA the host copy of an adapter is a few flat page-locked blocks, and a slot load replays an upload
plan built once per (slot, staged layout): ``mmlora.lora.staging``. With an ``upload_stream`` (CUDA,
one device), slot loads run on that stream beside the forwards: a slot is not ready
(:meth:`LoRAPool.slot_ready`) until its copies are done, and a loading slot is never a victim.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from mmlora.lora.adapter import LoadedAdapter
from mmlora.lora.pages import (
    PageMap,
    divides_into_pages,
    one_pair_each,
    pages_for,
    slot_pairs,
)
from mmlora.lora.spec import LoRAModelSpec
from mmlora.lora.staging import UploadPlan, UploadPlans, copy_scalings, pinned, scalings_of

logger = logging.getLogger(__name__)


class LoRAPool:
    def __init__(
        self,
        spec: LoRAModelSpec,
        num_slots: int,
        max_rank: int,
        max_loaded: int | None,
        dtype: torch.dtype,
        device: torch.device,
        on_slot_change: Callable[[int, int], None],
        page_rank: int | None = None,
    ) -> None:
        """``num_slots`` adapters of ``max_rank`` fit. ``page_rank``: store ranks in pages of this many (when
        it divides ``max_rank`` into several): an adapter takes the pages its rank needs
        (:mod:`mmlora.lora.pages`), its slot is its first page, and rank tile c of a slot is the slot's
        page c, so an adapter of rank <= page_rank reads one contiguous page, as in a pool of that rank,
        and smaller ranks leave room for more adapters (:class:`~mmlora.forward.lora.LoRAWeights`)."""
        self.spec = spec
        self._offsets = {t.name: t.slice_offsets for t in spec.targets}
        #: Adapters of max_rank the pool holds; ``num_slots`` is its slot ids (pages when paged).
        self.max_adapters = num_slots
        num_slots = self.num_slots = self.page_count(num_slots, max_rank, page_rank)
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        self.dtype = dtype
        self.device = device
        self._on_slot_change = on_slot_change  # (slot, rank) when a slot's content changes
        #: Counts writes into the slots (loads, zeroing, evictions): what was read from them before a change
        #: (a CPU plan's stacked copies) is stale once it moves.
        self.generation = 0
        self.buffers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # The pages behind each (layer, target)'s A and B views: [pages, n*U, in] and [pages, out, U].
        self._stores: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        paging = divides_into_pages(max_rank, page_rank)
        #: Ranks per page and the most pages an adapter takes (1 page of max_rank: the unpaged layout).
        self.page_rank, self.pages = (page_rank, max_rank // page_rank) if paging else (max_rank, 1)
        U, C = self.page_rank, self.pages
        for layer in range(spec.num_layers):
            for t in spec.targets:
                n, out_f = len(t.slices), sum(t.out_features)
                # C - 1 spare zero pages past the end: slot s views pages s .. s + C - 1 (an adapter reads
                # only its own, but the views must stay inside the storage).
                A_pages = torch.zeros(num_slots + C - 1, n * U, t.in_features, dtype=dtype, device=device)
                B_pages = torch.zeros(num_slots + C - 1, out_f, U, dtype=dtype, device=device)
                if paging:
                    pa, pb = A_pages.stride(0), B_pages.stride(0)
                    A = A_pages.as_strided((num_slots, C, n * U, t.in_features), (pa, pa, t.in_features, 1))
                    B = B_pages.as_strided((num_slots, C, out_f, U), (pb, pb, U, 1))
                else:
                    A, B = A_pages, B_pages
                scalings = torch.zeros(num_slots, n, dtype=torch.float32, device=device)
                self.buffers[(layer, t.name)] = (A, B, scalings)
                self._stores[(layer, t.name)] = (A_pages, B_pages)
        self.slot_uid: list[int | None] = [None] * num_slots
        self._ab_views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._scale_views: dict[int, list[torch.Tensor]] = {}
        self._uploads = UploadPlans(device, max_plans=4 * num_slots)
        self._layouts_seen: set[int] = set()
        # A and B elements each slot's adapter fills (the rest of the slot is rank padding, or modules
        # and slices it does not target): what slot_padding_fraction measures.
        self._slot_filled = [0] * num_slots
        self._page_elems = sum(A[0].numel() + B[0].numel() for A, B in self._stores.values())
        self._map = PageMap(num_slots)
        self._written_pages: dict[int, int] = {}  # slot -> pages its last write filled
        self._slot_of: dict[int, int] = {}
        self._slot_clock = [0] * num_slots
        self._clock = 0
        # Adapter loads into a slot since start: churn, which a scheduling policy that spreads admissions
        # over more adapters than slots drives up (each load copies the adapter's weights to the device).
        self.slot_loads = 0
        self.host: OrderedDict[int, LoadedAdapter] = OrderedDict()
        self.pinned: set[int] = set()
        # Set by the manager on CUDA (one device): slot loads go there, each slot's completion event kept
        # in ``_loading`` until slot_ready sees it done.
        self.upload_stream: torch.cuda.Stream | None = None
        self._loading: dict[int, torch.cuda.Event] = {}

    # ---- host cache -----------------------------------------------------------------------------

    def in_host(self, uid: int) -> bool:
        return uid in self.host

    def put_host(self, uid: int, adapter: LoadedAdapter, protected: set[int]) -> None:
        """Add a validated adapter to the host cache, evicting LRU ones that are not ``protected``. The
        first adapter of a staged layout builds that layout's upload plans for every slot here, at load
        time: a plan's first build (~450 slot views and the staging split) cost more than the upload
        itself, and a batch admitting many adapters at once paid it per fresh slot inside its step."""
        if self.device.type == "cuda":
            adapter = pinned(adapter)
        if (
            adapter.staged_layout is not None
            and adapter.staged_layout not in self._layouts_seen
            and one_pair_each(adapter, self.page_rank, self.pages)
        ):
            self._layouts_seen.add(adapter.staged_layout)
            scalings = scalings_of(adapter)
            # Every slot the adapter can be placed at: in a paged pool, the first pages aligned to its size.
            for slot in range(0, self.num_slots, self._pages_of_rank(adapter.rank)):
                self._plan(slot, adapter, scalings)
        self.host[uid] = adapter
        self.host.move_to_end(uid)
        if self.max_loaded is None:
            return
        for old in list(self.host):
            if len(self.host) <= self.max_loaded:
                break
            if old == uid or old in protected or old in self.pinned or old in self._slot_of:
                continue
            del self.host[old]
            logger.debug("evicted adapter %d from the host cache", old)

    def touch_host(self, uid: int) -> None:
        self.host.move_to_end(uid)

    # ---- device slots ---------------------------------------------------------------------------

    def slot_of(self, uid: int) -> int | None:
        return self._slot_of.get(uid)

    @staticmethod
    def page_count(adapters: int, max_rank: int, page_rank: int | None) -> int:
        """Slot ids of a pool holding ``adapters`` adapters of ``max_rank`` (pages when paged)."""
        return adapters * (max_rank // page_rank if divides_into_pages(max_rank, page_rank) else 1)

    def _pages_of_rank(self, rank: int) -> int:
        return pages_for(rank, self.page_rank, self.pages)

    def _evictable(self, uid: int, busy: set[int]) -> bool:
        if uid in busy or uid in self.pinned:
            return False
        first = self._slot_of[uid]
        return first not in self._loading or self.slot_ready(first)  # a load done since frees it

    def _place(self, pages: int, busy: set[int]) -> tuple[int, set[int]] | None:
        """(first page, adapters to evict) for an adapter of ``pages`` pages: free pages first, else the
        least recently used adapters outside ``busy``, not pinned and not loading."""
        return self._map.choose(
            pages, lambda u: self._evictable(u, busy), lambda u: self._slot_clock[self._slot_of[u]]
        )

    def can_get_slot(self, uid: int, busy: set[int], rank: int | None = None) -> bool:
        """Whether ``uid`` is resident, or an adapter of ``rank`` (default: the host copy's, else the
        pool's largest) can be placed without evicting one in ``busy``."""
        if uid in self._slot_of:
            return True
        if rank is None:
            rank = self.host[uid].rank if uid in self.host else self.max_rank
        return self._place(self._pages_of_rank(rank), busy) is not None

    def _slot_changed(self, slot: int, rank: int) -> None:
        self.generation += 1
        self._on_slot_change(slot, rank)

    def _evict(self, uid: int, new_first: int) -> None:
        """Forget ``uid``'s placement (its pages are being reused by an adapter starting at ``new_first``)."""
        first = self._slot_of.pop(uid)
        self._map.release(first)
        self.slot_uid[first] = None
        self._slot_filled[first] = 0
        if first != new_first:  # its first page is now inside another adapter, or free
            self._slot_changed(first, 0)

    def acquire_slot(self, uid: int, busy: set[int]) -> int | None:
        """The slot holding ``uid``, loading it (from the host cache) into free or LRU pages if needed."""
        self._clock += 1
        slot = self._slot_of.get(uid)
        if slot is None:
            pages = self._pages_of_rank(self.host[uid].rank)
            placed = self._place(pages, busy)
            if placed is None:
                return None
            slot, evicted = placed
            for old in evicted:
                self._evict(old, slot)
            self._map.take(slot, pages, uid)
            if self.upload_stream is None:
                self.write_slot(slot, self.host[uid])
            else:
                self._write_beside(slot, self.host[uid])
            self.slot_loads += 1
            self.slot_uid[slot] = uid
            self._slot_of[uid] = slot
        self._slot_clock[slot] = self._clock
        return slot

    def _write_beside(self, slot: int, adapter: LoadedAdapter) -> None:
        """``write_slot`` on the upload stream, after the work already queued on the current stream (it may
        still read the slot's previous adapter); the slot is loading until that write is done."""
        stream = self.upload_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.write_slot(slot, adapter)
            done = torch.cuda.Event()
            done.record(stream)
        self._loading[slot] = done

    def slot_ready(self, slot: int) -> bool:
        """Whether ``slot`` holds its adapter (False while its load still runs on the upload stream). Once
        done, the current stream is ordered after the load (no host wait)."""
        done = self._loading.get(slot)
        if done is None:
            return True
        if not done.query():
            return False
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(done)
        del self._loading[slot]
        return True

    def _settle(self, slot: int) -> None:
        """Wait for ``slot``'s load, if one runs (before the slot is zeroed or dropped: rare)."""
        done = self._loading.pop(slot, None)
        if done is not None:
            done.synchronize()

    def drop(self, uid: int) -> None:
        """Forget an adapter entirely: its slot (zeroed) and its host copy."""
        slot = self._slot_of.pop(uid, None)
        if slot is not None:
            self.slot_uid[slot] = None
            self._map.release(slot)
            self.clear_slot(slot)
        self.host.pop(uid, None)
        self.pinned.discard(uid)

    def clear_slot(self, slot: int) -> None:
        """Zero a slot's weights: the pages its last write filled (a tensor-parallel worker's pool knows
        them this way too); its bookkeeping is the caller's."""
        self._settle(slot)
        torch._foreach_zero_(self._slot_ab_views(slot, self._written_pages.pop(slot, 1)))
        torch._foreach_zero_(self._slot_scale_views(slot))
        self._slot_filled[slot] = 0
        self._slot_changed(slot, 0)

    def _slot_ab_views(self, slot: int, pages: int = 1) -> list[torch.Tensor]:
        """The views of ``pages`` pages from ``slot`` of every A and B buffer (one dtype: multi-tensor
        kernels zero a list of them in one launch), made once per (slot, pages). Asked only where a slot
        is zeroed: making them costs about 1 ms (a Mistral-7B pool: 256 views), and a paged pool's slots
        are many (512 in issue 13's runs), so a first upload into each would pay it."""
        views = self._ab_views.get((slot, pages))
        if views is None:
            views = self._ab_views[(slot, pages)] = [
                t[slot : slot + pages] for A, B in self._stores.values() for t in (A, B)
            ]
        return views

    def _slot_scale_views(self, slot: int) -> list[torch.Tensor]:
        """The views of ``slot``'s scalings (fp32) in every module's buffer, made once per slot."""
        views = self._scale_views.get(slot)
        if views is None:
            views = self._scale_views[slot] = [sc[slot] for _, _, sc in self.buffers.values()]
        return views

    def _plan(self, slot: int, adapter: LoadedAdapter, scalings: torch.Tensor) -> UploadPlan:
        """The upload plan of a staged adapter into ``slot`` (:meth:`UploadPlans.get`)."""
        return self._uploads.get(
            slot,
            adapter,
            scalings,
            self.upload_stream,
            lambda: slot_pairs(self.buffers, self._offsets, slot, adapter, self.page_rank, self.pages),
            lambda: [
                (self.buffers[k][2][slot] if k in self.buffers else None, len(w.scalings))
                for k, w in adapter.weights.items()
            ],
        )

    def write_slot(self, slot: int, adapter: LoadedAdapter) -> None:
        """Copy ``adapter`` (shaped as this pool's spec) into ``slot`` (its bookkeeping is the caller's)."""
        # Batched: multi-tensor zeroing and copies, not a launch per tensor and per scaling (an upload
        # touches every (layer, module) buffer: ~1,300 launches, 17 ms of host time per Mistral-7B
        # adapter on an H200 before; issue 13).
        pages = self._written_pages[slot] = self._pages_of_rank(adapter.rank)
        scale_views = self._slot_scale_views(slot)
        scalings = scalings_of(adapter) if adapter.staged is not None else None
        plan = (
            self._plan(slot, adapter, scalings)
            if scalings is not None and one_pair_each(adapter, self.page_rank, self.pages)
            else None
        )
        if plan is None or plan.filled < pages * self._page_elems:  # else every element is overwritten
            torch._foreach_zero_(self._slot_ab_views(slot, pages))
        torch._foreach_zero_(scale_views)
        if plan is not None:
            plan.run(adapter.staged, scalings)
            filled = plan.filled
        else:
            pairs = slot_pairs(self.buffers, self._offsets, slot, adapter, self.page_rank, self.pages)
            kept = [(d, t.reshape(d.shape)) for d, t in pairs if d is not None]  # shards may be strided
            if kept:
                torch._foreach_copy_([d for d, _ in kept], [t for _, t in kept], non_blocking=True)
            filled = sum(t.numel() for d, t in pairs if d is not None)
            copy_scalings(self.buffers, scale_views, adapter, self.device)
        self._slot_filled[slot] = filled  # A and B
        self._slot_changed(slot, adapter.rank)

    @property
    def slots_used(self) -> int:
        return len(self._slot_of)

    def resident(self) -> set[int]:
        """The adapters placed in device slots (loaded, or loading)."""
        return set(self._slot_of)

    def close(self) -> None:
        """Drop the slot buffers and the host cache (``LoRALinear`` views of the buffers go separately)."""
        for slot in list(self._loading):
            self._settle(slot)
        self.buffers.clear()
        self._stores.clear()
        self._ab_views.clear()
        self._scale_views.clear()
        self._uploads.clear()
        self.host.clear()

    def slot_padding_fraction(self, slots: Iterable[int] | None = None) -> float:
        """The share of the A/B memory of ``slots`` (default: every occupied slot) that their adapters
        leave empty (0 for no slot). Unpaged slots are sized for ``max_rank`` on every target, so a
        rank-8 adapter in a rank-64 pool leaves 87.5% of its slot empty (issue 23); paged, it takes one
        page of ``page_rank``."""
        if slots is None:
            slots = (s for s, u in enumerate(self.slot_uid) if u is not None)
        occupied = list(slots)
        if not occupied:
            return 0.0
        held = sum(self._map.count.get(s, 1) for s in occupied) * self._page_elems
        return 1.0 - sum(self._slot_filled[s] for s in occupied) / held

    def nbytes(self) -> int:
        tensors = [t for pages in self._stores.values() for t in pages]
        tensors += [sc for _, _, sc in self.buffers.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
