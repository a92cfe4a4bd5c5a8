"""PageMap.choose against a brute-force scan of every aligned window (the rule its docstring states)."""

import random

import pytest

from mmlora.lora.pages import PageMap


def scan_every_window(owner, pages, evictable, age, limit=None):
    """The rule, written plainly: the first fully free window (within the first ``limit`` pages); else,
    over windows whose owners may all be evicted, the one whose newest owner is oldest (the first on
    ties); else None."""
    best = None
    end = len(owner) if limit is None else limit
    for start in range(0, end - pages + 1, pages):
        owners = {u for u in owner[start : start + pages] if u is not None}
        if not owners:
            return start, set()
        if all(evictable(u) for u in owners):
            newest = max(age(u) for u in owners)
            if best is None or newest < best[0]:
                best = (newest, start, owners)
    return None if best is None else (best[1], best[2])


def random_map(rng: random.Random, num_pages: int, fill: float) -> PageMap:
    """Adapters of 1, 2, 4 or 8 pages placed at windows aligned to their size (as the pool places them)."""
    pm = PageMap(num_pages)
    uid = 0
    for _ in range(4 * num_pages):
        size = rng.choice([1, 1, 1, 2, 4, 8])
        if size > num_pages:
            continue
        start = rng.randrange(0, num_pages // size) * size
        if rng.random() < fill and all(o is None for o in pm.owner[start : start + size]):
            pm.take(start, size, uid)
            uid += 1
    return pm


@pytest.mark.parametrize("seed", range(60))
def test_choose_matches_a_scan_of_every_window(seed: int) -> None:
    rng = random.Random(seed)
    num_pages = rng.choice([1, 4, 16, 64])
    pm = random_map(rng, num_pages, fill=rng.choice([0.3, 0.9, 1.0]))
    uids = {pm.owner[first] for first in pm.count}
    busy = {u for u in uids if rng.random() < rng.choice([0.0, 0.3, 0.9])}
    # Ages as a pool's clock gives them (distinct), or with ties, which go to the first window.
    ages = {u: rng.randrange(0, 3 if seed % 2 else 10**6) for u in uids}

    def evictable(u: int) -> bool:
        return u not in busy

    for pages in (1, 2, 4, 8):
        if pages > num_pages:
            continue
        want = scan_every_window(list(pm.owner), pages, lambda u: u not in busy, ages.__getitem__)
        assert pm.choose(pages, evictable, ages.__getitem__) == want, (pages, pm.owner, busy, ages)
        # Within a prefix (a staged GEMM's narrower layouts): owners may reach past it.
        limit = rng.randrange(pages, num_pages + 1)
        want = scan_every_window(list(pm.owner), pages, evictable, ages.__getitem__, limit)
        got = pm.choose(pages, evictable, ages.__getitem__, limit=limit)
        assert got == want, (pages, limit, pm.owner, busy, ages)


def test_a_full_pool_of_one_page_adapters_evicts_the_least_recent_idle_one() -> None:
    pm = PageMap(8)
    for page in range(8):
        pm.take(page, 1, 100 + page)
    ages = {100 + p: a for p, a in enumerate([5, 3, 9, 1, 7, 2, 8, 4])}
    assert pm.choose(1, lambda u: True, ages.__getitem__) == (3, {103})
    assert pm.choose(1, lambda u: u != 103, ages.__getitem__) == (5, {105})
    assert pm.choose(1, lambda u: False, ages.__getitem__) is None
    pm.release(6)
    assert pm.choose(1, lambda u: False, ages.__getitem__) == (6, set())
