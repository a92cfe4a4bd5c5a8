"""Paged KV cache: a refcounting page allocator over ``num_blocks`` pages of ``block_size`` tokens, and the
cache tensors.

Every page is in exactly one of three states: *free* (on the free list), *referenced* (refcount > 0: in
the block table of one or more requests) or *cached* (refcount 0, but its contents are registered in
the prefix cache and may be reused). Cached pages are evicted least recently released first, and only
when ``allocate`` runs out of free pages.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable

import torch


class BlockAllocator:
    """Hands out page ids; a page may be shared (refcount > 1) once the prefix cache matched it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("BlockAllocator: num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached = [False] * num_blocks  # registered in the prefix cache
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._reserved: set[int] = set()
        # Called with a cached page the allocator evicts, so the prefix cache forgets its key.
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out: free ones plus unreferenced cached ones (evicted on demand)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_unreferenced(self) -> int:
        return len(self._evictable)

    def blocks_needed(self, num_tokens: int, have: int) -> int:
        """Pages to add so that ``num_tokens`` fit, given ``have`` pages already."""
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"KV cache out of pages: asked {n}, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._cached[b] = False
                if self.on_evict is not None:
                    self.on_evict(b)
            self.refcount[b] = 1
            blocks.append(b)
        return blocks

    def share(self, block: int) -> None:
        """One more reference to a cached page (a prefix-cache hit)."""
        if not self._cached[block]:
            raise RuntimeError(f"KV page {block} is not cached and cannot be shared")
        if self.refcount[block] == 0:
            del self._evictable[block]
        self.refcount[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each page. Pages are released last first, so that when cached pages
        are evicted later, a sequence's tail goes before the prefix other requests may share."""
        for b in reversed(list(blocks)):
            if self.refcount[b] <= 0:
                raise RuntimeError(f"KV page {b} freed twice")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                if self._cached[b]:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # ---- the prefix cache's view ------------------------------------------------------------------

    def is_cached(self, block: int) -> bool:
        return self._cached[block]

    def mark_cached(self, block: int) -> None:
        """Register a referenced page's contents for reuse (the prefix cache keeps its key)."""
        if self.refcount[block] <= 0:
            raise RuntimeError(f"KV page {block} is not referenced; only computed pages can be cached")
        self._cached[block] = True

    def uncache(self, block: int) -> None:
        """Forget that a page is cached; if nothing references it, it becomes free."""
        if not self._cached[block]:
            return
        self._cached[block] = False
        if self.refcount[block] == 0:
            del self._evictable[block]
            self._free.append(block)

    def reserve_page(self) -> int:
        """Take one page out of circulation for good (CUDA graphs' padding page)."""
        if self.num_free < 2:
            raise RuntimeError("KV cache too small to reserve a page")
        page = self.allocate(1)[0]
        self._reserved.add(page)
        self.num_blocks -= 1
        return page

    def check_invariants(self) -> None:
        """Raise AssertionError if the page states are inconsistent (tests call it after every event)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a page is on the free list twice"
        referenced = {b for b, c in enumerate(self.refcount) if c > 0} - self._reserved
        assert not free & referenced, "a page is both free and referenced"
        assert not evictable & referenced, "a page is both evictable and referenced"
        assert not free & evictable, "a page is both free and cached"
        assert all(c >= 0 for c in self.refcount), "negative refcount"
        assert all(self._cached[b] for b in evictable), "an evictable page is not cached"
        assert not any(self._cached[b] for b in free), "a free page is still cached"
        assert len(free) + len(evictable) + len(referenced) == self.num_blocks, "pages lost or duplicated"

    @property
    def num_referenced(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        """Fraction of pages referenced by requests (cached but unreferenced pages count as free)."""
        return self.num_referenced / self.num_blocks


class KVCache:
    """One K and one V tensor per layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        # glibc serves a CPU allocation past its 32 MiB mmap threshold from fresh mmap pages, which are
        # zero and cost memory only once touched: zeroing SmolLM2's default 1.5 GB by hand took 2-3 s of
        # a build. Smaller ones may reuse freed heap memory, and CUDA's caching allocator reuses used
        # memory: those are zeroed (a masked-out position times a stale NaN would still be NaN).
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        fresh_pages = device.type == "cpu" and nbytes >= 64 << 20
        alloc = torch.empty if fresh_pages else torch.zeros
        self.data = alloc(shape, dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks, block_size)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, 0], self.data[i, 1]

    def close(self) -> None:
        """Drop the cache tensor (freed once no layer holds a view of it); ``layer`` fails after this."""
        self.data = None

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
