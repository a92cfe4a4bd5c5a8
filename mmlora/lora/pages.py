"""Where adapters sit in a pool paged by rank tile: an adapter of rank r takes :func:`pages_for` pages,
a power of two of them aligned to its own size (as a buddy allocator places blocks), and its first page
is its slot. Alignment keeps the pool from fragmenting: with fewer adapters busy than the pool holds at
the largest rank, some aligned window of the largest size holds no busy adapter, so every adapter can be
placed by evicting idle ones. An unpaged pool is the case of one page an adapter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmlora.lora.adapter import LoadedAdapter

Views = list[tuple[torch.Tensor, torch.Tensor]]


def pages_for(rank: int, page_rank: int, max_pages: int) -> int:
    """Pages an adapter of ``rank`` takes: its rank tiles rounded up to a power of two, at most
    ``max_pages`` (at least one)."""
    tiles = max(1, -(-rank // page_rank))
    pages = 1
    while pages < tiles:
        pages *= 2
    return min(pages, max_pages)


def divides_into_pages(max_rank: int, page_rank: int | None) -> bool:
    """Whether ``page_rank`` pages a pool of ``max_rank`` (it divides it into several pages)."""
    return page_rank is not None and 1 <= page_rank < max_rank and max_rank % page_rank == 0


#: The page rank of a CUDA pool whose ``lora_page_rank`` is not set. H200, Mistral-7B, 32 rank-16 adapters
#: (benchmarks/results/h200-2026-12-03-session17): in a rank-64 pool paged by 16 the LoRA kernels take the
#: time of a rank-16 pool's (decode runs 67 against 89 us unpaged, mixed steps 232 against 258), and
#: serving ran ahead of the unpaged pool in both rounds.
CUDA_PAGE_RANK = 16


def resolve_page_rank(page_rank: int | None, max_rank: int, device: torch.device) -> int | None:
    """The page rank a pool of ``max_rank`` uses, None when unpaged. A set ``page_rank`` is kept when it
    divides ``max_rank`` into several pages (``max_rank`` itself: unpaged). Unset: on CUDA,
    :data:`CUDA_PAGE_RANK` when ``max_rank`` is that times a power of two above one, so every
    adapter takes a power of two of pages, as the buddy placement assumes; elsewhere unpaged (the CPU
    path stacks each slot's live ranks, so padding costs it nothing)."""
    if page_rank is not None:
        return page_rank if divides_into_pages(max_rank, page_rank) else None
    if device.type != "cuda" or max_rank % CUDA_PAGE_RANK:
        return None
    pages = max_rank // CUDA_PAGE_RANK
    return CUDA_PAGE_RANK if pages > 1 and pages & (pages - 1) == 0 else None


class PageMap:
    """Which adapter (uid) owns each page, and how many pages each placed adapter's first page starts."""

    def __init__(self, num_pages: int) -> None:
        self.owner: list[int | None] = [None] * num_pages
        self.count: dict[int, int] = {}  # first page -> pages

    def choose(
        self,
        pages: int,
        evictable: Callable[[int], bool],
        age: Callable[[int], int],
        limit: int | None = None,
    ) -> tuple[int, set[int]] | None:
        """(first page, uids to evict) of an aligned window of ``pages`` pages: the first free one, else
        the one whose owners are all ``evictable`` and whose most recent use (``age``, larger is newer)
        is oldest, the first such window on ties; None when every window holds an adapter that may not be
        evicted. With ``limit``, only windows within the first ``limit`` pages (an owner there may
        reach past it: evicting it frees all its pages).

        The scheduler asks this for every adapter it loads, twice (can it, then where), and prefetches
        ask too: with a full pool of 512 one-page adapters a scan that built each window's owner set and
        asked its owners again per window took about 0.5 ms; each adapter's verdict and age are asked once
        per call here (about 0.15 ms)."""
        owner = self.owner if limit is None else self.owner[:limit]
        if None in owner:  # a free window, if any, wins: look for one only where a page is free
            if pages == 1:
                return owner.index(None), set()
            for start in range(0, len(owner) - pages + 1, pages):
                if owner[start] is None and owner[start : start + pages].count(None) == pages:
                    return start, set()
        # Each placed adapter's age, or None where it may not be evicted: asked once per adapter.
        every = self.owner
        verdict = {
            every[first]: age(every[first]) if evictable(every[first]) else None for first in self.count
        }
        chosen: tuple[int, int] | None = None  # (newest age in the window, its first page)
        for start in range(0, len(owner) - pages + 1, pages):
            newest = None
            for uid in owner[start : start + pages]:
                if uid is None:
                    continue
                stamp = verdict[uid]
                if stamp is None:
                    break
                if newest is None or stamp > newest:
                    newest = stamp
            else:
                if chosen is None or newest < chosen[0]:
                    chosen = (newest, start)
        if chosen is None:
            return None
        start = chosen[1]
        return start, {u for u in owner[start : start + pages] if u is not None}

    def copy(self) -> PageMap:
        other = PageMap(0)
        other.owner, other.count = list(self.owner), dict(self.count)
        return other

    def take(self, first: int, pages: int, uid: int) -> None:
        self.owner[first : first + pages] = [uid] * pages
        self.count[first] = pages

    def release(self, first: int) -> int:
        """Free the pages starting at ``first``; returns how many."""
        pages = self.count.pop(first)
        self.owner[first : first + pages] = [None] * pages
        return pages


# Where an adapter's tensors go in its slot's views (A [pages, n*U, in], B [pages, out, U] when paged, else
# A [n*R, in], B [out, R]): (view, source) pairs whose views list their elements in the source's order.


def a_views(A: torch.Tensor, i: int, t: torch.Tensor, U: int, pages: int) -> Views:
    """(view of a slot's A, source rows) for slice ``i``'s A rows ``t`` [r, in]."""
    r = t.shape[0]
    if pages == 1:
        return [(A[i * U : i * U + r], t)]
    if r <= U:
        return [(A[0, i * U : i * U + r], t)]
    if r % U == 0:  # rank tile c of slice i is rows i*U.. of page c: [pages, U, in], the source's order
        return [(A[: r // U, i * U : (i + 1) * U], t)]
    return [(A[c, i * U : i * U + min(U, r - c * U)], t[c * U : (c + 1) * U]) for c in range(-(-r // U))]


def b_views(B: torch.Tensor, lo: int, hi: int, t: torch.Tensor, U: int, pages: int) -> Views:
    """(view of a slot's B, source columns) for the B columns ``t`` [out, r] of output rows lo:hi."""
    r = t.shape[1]
    if pages == 1:
        return [(B[lo:hi, :r], t)]
    if r <= U:
        return [(B[0, lo:hi, :r], t)]
    if r % U == 0:  # [out, pages, U]: the source's order
        return [(B[: r // U, lo:hi].permute(1, 0, 2), t)]
    return [(B[c, lo:hi, : min(U, r - c * U)], t[:, c * U : (c + 1) * U]) for c in range(-(-r // U))]


def one_pair_each(adapter: LoadedAdapter, U: int, pages: int) -> bool:
    """Whether every tensor of ``adapter`` lands in one view (what an upload plan copies): unpaged, or
    each rank within a page or a whole number of pages."""
    return pages == 1 or all(
        t.shape[d] <= U or t.shape[d] % U == 0
        for w in adapter.weights.values()
        for d, ts in ((0, w.A), (1, w.B))
        for t in ts
        if t is not None
    )


def flat_view(view: torch.Tensor) -> torch.Tensor:
    """A view flat where it is contiguous (multi-tensor copies pair it with a flat staging chunk)."""
    return view.view(-1) if view.is_contiguous() else view


def slot_pairs(
    buffers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    offsets: dict[str, tuple[int, ...]],
    slot: int,
    adapter: LoadedAdapter,
    U: int,
    pages: int,
) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """(slot view, or None for a module the pool does not hold; source) for every A and B tensor of
    ``adapter`` in ``slot`` of a pool's ``buffers`` ((layer, target) -> (A, B, scalings); ``offsets``:
    each target's slice offsets; ``U``, ``pages``: its page rank and pages per slot): A then B of every
    slice, module by module in the adapter's order (a staged adapter's block order). A slot view is flat
    where contiguous, so multi-tensor copies pair it with a flat chunk of a staging buffer; a B view below
    the pool rank (B[slot, rows, :r]) is strided. A view lists its elements in its source's order (a paged
    view spans pages). In a paged pool, a rank above one page and not a whole number of pages takes one
    pair per page (see :func:`one_pair_each`)."""
    pairs: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    for key, w in adapter.weights.items():
        bufs = buffers.get(key)
        if bufs is None:
            pairs += [(None, t) for t in (*w.A, *w.B) if t is not None]
            continue
        A, B = bufs[0][slot], bufs[1][slot]
        offs = offsets[key[1]]
        for i, t in enumerate(w.A):
            if t is not None:
                pairs += [(flat_view(d), s) for d, s in a_views(A, i, t, U, pages)]
        for i, t in enumerate(w.B):
            if t is not None:
                pairs += [(flat_view(d), s) for d, s in b_views(B, offs[i], offs[i + 1], t, U, pages)]
    return pairs
