"""``PrefixCache.keys`` (one pass over a sequence's new pages) against the per-page definition it replaced.

The oracle is the earlier loop, kept here verbatim in spirit: for each full page, the images whose
placeholder run overlaps it by an interval test, and ``page_key`` of (parent, adapter uid, the page's
ids, those images). Random prompts, adapter uids and image spans (fixed seed); keys asked for in one call
and in growing pieces (the memo is extended as a request grows) must be the same bytes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from mmlora.kvcache.allocator import BlockAllocator
from mmlora.kvcache.prefix_cache import PrefixCache, page_key


@dataclass
class _Images:
    spans: list[tuple[int, int]]
    image_hashes: list[bytes]


@dataclass
class _Seq:
    all_ids: list[int]
    adapter_uid: int
    mm_inputs: _Images | None = None
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0


def _reference_keys(seq: _Seq, num_tokens: int, bs: int) -> list[bytes]:
    """The per-page loop keys() had before it became one pass."""
    spans = [] if seq.mm_inputs is None else list(zip(seq.mm_inputs.spans, seq.mm_inputs.image_hashes))
    keys: list[bytes] = []
    for i in range(num_tokens // bs):
        lo, hi = i * bs, (i + 1) * bs
        images = [h for (s, n), h in spans if s < hi and lo < s + n]
        keys.append(page_key(keys[-1] if keys else b"", seq.adapter_uid, seq.all_ids[lo:hi], images))
    return keys


def _random_seq(rng: random.Random, bs: int) -> _Seq:
    ids = [rng.randrange(0, 1 << 40) for _ in range(rng.randrange(0, 12 * bs))]
    images = None
    if rng.random() < 0.5 and ids:
        spans, pos = [], rng.randrange(0, len(ids))
        while pos < len(ids) and len(spans) < 4:
            length = rng.randrange(0, 3 * bs)  # 0: an empty run, which may still fall inside a page
            spans.append((pos, length))
            pos += length + rng.randrange(0, 2 * bs)
        images = _Images(spans, [rng.randbytes(32) for _ in spans])
    return _Seq(ids, adapter_uid=rng.choice([-1, 0, 1, 7, 1 << 40]), mm_inputs=images)


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_keys_equal_the_per_page_definition(bs: int) -> None:
    rng = random.Random(1234 + bs)
    cache = PrefixCache(BlockAllocator(num_blocks=8, block_size=bs))
    for _ in range(300):
        seq = _random_seq(rng, bs)
        n = len(seq.all_ids)
        whole = cache.keys(seq, n)
        assert whole == _reference_keys(seq, n, bs)
        grown = _Seq(seq.all_ids, seq.adapter_uid, seq.mm_inputs)
        cut = 0
        while cut < n:  # the memo extended in pieces, as a request's prefill and decode grow it
            cut = min(n, cut + rng.randrange(1, 3 * bs))
            assert cache.keys(grown, cut) == whole[: cut // bs]


def test_keys_differ_by_adapter_and_by_image() -> None:
    cache = PrefixCache(BlockAllocator(num_blocks=8, block_size=4))
    ids = list(range(16))
    a, b = _Seq(ids, adapter_uid=1), _Seq(ids, adapter_uid=2)
    assert not set(cache.keys(a, 16)) & set(cache.keys(b, 16))
    img1 = _Seq(ids, 1, _Images([(5, 3)], [b"\x01" * 32]))
    img2 = _Seq(ids, 1, _Images([(5, 3)], [b"\x02" * 32]))
    k1, k2 = cache.keys(img1, 16), cache.keys(img2, 16)
    assert k1[0] == k2[0] == cache.keys(a, 16)[0]  # page 0 ends before the image
    assert all(x != y for x, y in zip(k1[1:], k2[1:]))  # page 1 holds it; later pages chain on it
