"""Prefix cache over KV pages, keyed by adapter identity, token ids and image contents.

Design: hashed full pages chained to their parent (vLLM's scheme), not a radix tree of page-sized runs
(SGLang's). The key of page i of a sequence is

    sha256(key of page i - 1, adapter uid, the page's token ids, content hashes of the images whose
           placeholder tokens the page covers)

so equal keys mean equal K/V: the same adapter (by uid, which changes when an adapter is unloaded and
loaded again, never by name), the same tokens at the same positions, the same pixels. Why hashes over a
tree: mmlora's allocator shares whole pages only, so a tree's finer token-level matching buys nothing;
a flat ``{key: page}`` map makes match and insert O(pages) with no tree surgery on eviction (any
unreferenced page can go: a child whose parent was evicted is simply unreachable until evicted too);
and the per-page key is the natural place for the extra parts (adapter uid, image hashes) that make
multi-LoRA and VLM sharing safe. Key collisions would need a sha256 collision.

Pages are refcounted by the :class:`~mmlora.kvcache.allocator.BlockAllocator`; a cached page nobody
references stays in the cache until ``allocate`` needs it (LRU). A request starts prefill at its first
uncached token; at least its last prompt token is always computed, so that it has logits to sample.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from typing import Protocol

from mmlora.kvcache.allocator import BlockAllocator


class ImageSpans(Protocol):
    """What the cache needs of a request's multimodal inputs: where each image's tokens are, and its hash."""

    spans: list[tuple[int, int]]  # (start, length) of each image's placeholder run
    image_hashes: list[bytes]


class CachedSequence(Protocol):
    """What the cache needs of a request."""

    all_ids: list[int]
    num_computed: int
    blocks: list[int]
    block_hashes: list[bytes]  # keys of its full pages, extended as it grows
    num_registered_blocks: int  # its leading pages that are in the cache (matched or inserted)
    mm_inputs: ImageSpans | None

    @property
    def adapter_uid(self) -> int: ...


def page_key(parent: bytes, adapter_uid: int, tokens: Sequence[int], images: Sequence[bytes]) -> bytes:
    """The key of one page, as the module docstring defines it (``PrefixCache.keys`` computes the same
    bytes for many pages at once; a test holds the two equal)."""
    h = hashlib.sha256(parent)
    h.update(struct.pack("<q", adapter_uid))
    h.update(array("q", tokens).tobytes())
    for image in images:
        h.update(image)
    return h.digest()


def _page_images(mm: ImageSpans | None, block_size: int, first: int, end: int) -> list[list[bytes]]:
    """Per page in [first, end), the hashes of the images whose placeholder run overlaps it, in image
    order: one sweep over the images, each touching only its own pages."""
    per_page: list[list[bytes]] = [[] for _ in range(end - first)]
    if mm is None:
        return per_page
    for (start, length), image in zip(mm.spans, mm.image_hashes):
        # pages p with p*bs < start+length and start < (p+1)*bs (an empty run strictly inside a page
        # overlaps it, as the interval test does)
        lo = max(start // block_size, first)
        hi = min((start + length - 1) // block_size, end - 1)
        for page in range(lo, hi + 1):
            per_page[page - first].append(image)
    return per_page


class PrefixCache:
    """Matches and registers full KV pages; counts queried and hit tokens (vLLM's counters)."""

    def __init__(self, allocator: BlockAllocator, enabled: bool = True) -> None:
        self.allocator = allocator
        self.enabled = enabled
        self.block_size = allocator.block_size
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._uid_of: dict[int, int] = {}
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of which found cached
        allocator.on_evict = self._forget

    @property
    def num_cached_pages(self) -> int:
        return len(self._key_of)

    def _forget(self, page: int) -> None:
        key = self._key_of.pop(page)
        del self._page_of[key]
        del self._uid_of[page]

    def keys(self, seq: CachedSequence, num_tokens: int) -> list[bytes]:
        """The keys of the sequence's full pages within its first ``num_tokens`` tokens (memoised on it).

        One pass over the new pages: their token ids become bytes in one conversion and each page's key
        is one sha256 over (parent key, adapter uid, the page's slice, its images), the bytes page_key
        hashes."""
        bs, keys = self.block_size, seq.block_hashes
        want = num_tokens // bs
        first = len(keys)
        if first < want:
            tokens = memoryview(array("q", seq.all_ids[first * bs : want * bs]).tobytes())
            uid = struct.pack("<q", seq.adapter_uid)
            images = _page_images(seq.mm_inputs, bs, first, want)
            step = 8 * bs  # bytes of one page's ids
            parent = keys[-1] if keys else b""
            sha256 = hashlib.sha256
            for j in range(want - first):
                h = sha256(parent)
                h.update(uid)
                h.update(tokens[j * step : (j + 1) * step])
                for image in images[j]:
                    h.update(image)
                parent = h.digest()
                keys.append(parent)
        return keys[:want]

    def lookup(self, seq: CachedSequence) -> tuple[list[int], bytes | None]:
        """The cached pages of the sequence's longest cached run of leading full pages, and the key of the
        first full page after that run (None if there is none). The last token never counts: it samples."""
        if not self.enabled:
            return [], None
        pages = []
        for key in self.keys(seq, len(seq.all_ids) - 1):
            page = self._page_of.get(key)
            if page is None:
                return pages, key
            pages.append(page)
        return pages, None

    def take(self, seq: CachedSequence, pages: list[int]) -> int:
        """Give a sequence that holds no pages the ``pages`` of a lookup (one more reference each) and
        start its prefill after them; returns the number of tokens it skips."""
        if seq.blocks or seq.num_computed:
            raise RuntimeError("prefix cache: take() is for a sequence that holds no pages")
        for page in pages:
            self.allocator.share(page)
        seq.blocks = list(pages)
        seq.num_registered_blocks = len(pages)
        seq.num_computed = len(pages) * self.block_size
        return seq.num_computed

    def record(self, queried: int, hit: int) -> None:
        """Count one admitted lookup (in tokens), for ``vllm:prefix_cache_queries`` / ``_hits``."""
        self.queries += queried
        self.hits += hit

    def pending_keys(self, seq: CachedSequence) -> list[bytes]:
        """Keys of the full prompt pages a running sequence will compute but has not cached yet."""
        if not self.enabled:
            return []
        return self.keys(seq, len(seq.all_ids))[seq.num_registered_blocks :]

    def insert(self, seq: CachedSequence) -> None:
        """Register the sequence's pages that became full since the last call (of tokens it knows: a
        computed position whose token id is still pending waits for a later call)."""
        done = min(seq.num_computed, len(seq.all_ids))
        if not self.enabled or done // self.block_size <= seq.num_registered_blocks:
            return
        keys = self.keys(seq, done)
        for i in range(seq.num_registered_blocks, len(keys)):
            page, key = seq.blocks[i], keys[i]
            if key not in self._page_of:  # else another request computed it first: this copy stays private
                self._page_of[key] = page
                self._key_of[page] = key
                self._uid_of[page] = seq.adapter_uid
                self.allocator.mark_cached(page)
        seq.num_registered_blocks = max(seq.num_registered_blocks, len(keys))

    def drop_adapter(self, adapter_uid: int) -> int:
        """Forget every page computed under an adapter (it is being unloaded); returns how many."""
        pages = [p for p, uid in self._uid_of.items() if uid == adapter_uid]
        for page in pages:
            self._forget(page)
            self.allocator.uncache(page)
        return len(pages)

    def flush(self) -> int:
        """Forget every cached page; returns how many. Referenced pages stay with their requests."""
        pages = list(self._key_of)
        for page in pages:
            self._forget(page)
            self.allocator.uncache(page)
        return len(pages)

    def stats(self) -> dict[str, int | bool]:
        return {
            "prefix_cache_enabled": self.enabled,
            "prefix_cache_queries_total": self.queries,
            "prefix_cache_hits_total": self.hits,
            "prefix_cache_pages": self.num_cached_pages,
        }
