"""Page allocator + prefix cache invariants under random add / step / finish / abort / preempt sequences.

Property-based (hypothesis, fixed seed): the real Scheduler drives a BlockAllocator and a PrefixCache
over requests whose prompts share a few prefixes under three adapter identities. After every event:
no page is both free and referenced, a page's refcount equals the number of requests holding it,
cached + free + referenced pages equal all pages; at the end every refcount is back to zero. The model
forward is left out: these invariants are about pages, not their contents.
"""

from __future__ import annotations

from hypothesis import given, seed, settings
from hypothesis import strategies as st

from mmlora.config import SchedulerConfig
from mmlora.engine.request import Request, Status
from mmlora.engine.sampling_params import SamplingParams
from mmlora.engine.scheduler import Scheduler
from mmlora.kvcache.allocator import BlockAllocator
from mmlora.kvcache.prefix_cache import PrefixCache
from mmlora.lora.registry import AdapterEntry

BLOCK = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9], [20, 21, 22, 23, 24, 25, 26, 27]]
ADAPTERS = [None, AdapterEntry("a", "/a", uid=1), AdapterEntry("b", "/b", uid=2)]


class _AnySlot:
    """LoRA admission out of the way: every adapter gets slot 0 (slots are not what is tested here)."""

    loads_async = False

    def can_admit(self, entry: AdapterEntry, busy: set[int]) -> bool:
        return True

    def admit(self, entry: AdapterEntry, busy: set[int]) -> int:
        return 0


def _check(sched: Scheduler, alloc: BlockAllocator, cache: PrefixCache, live: list[Request]) -> None:
    alloc.check_invariants()
    holders = [0] * len(alloc.refcount)
    for req in live:
        for b in req.blocks:
            holders[b] += 1
    assert holders == alloc.refcount, "a refcount differs from the number of requests holding the page"
    cached = sum(alloc.is_cached(b) for b in range(len(alloc.refcount)))
    assert cached == cache.num_cached_pages
    unreferenced_cached = sum(
        alloc.is_cached(b) and alloc.refcount[b] == 0 for b in range(len(alloc.refcount))
    )
    assert unreferenced_cached == alloc.num_cached_unreferenced


def _forward(sched: Scheduler, batch, rng_token: int, max_new: int) -> list[Request]:
    """What the engine does after a forward: advance, cache the filled pages, append a token, finish."""
    done = []
    for req, n in zip(batch.requests, batch.num_new):
        req.num_computed += n
    sched.after_forward(batch.requests)
    for req in batch.requests:
        if req.num_computed == req.num_tokens and req.status is Status.RUNNING:
            req.output_ids.append(rng_token)
            if len(req.output_ids) >= max_new:
                done.append(req)
    return done


ADD = st.tuples(
    st.just("add"), st.integers(0, 2), st.integers(0, 2), st.lists(st.integers(30, 40), max_size=6)
)
STEP = st.tuples(st.just("step"), st.integers(30, 40))
EVENTS = st.lists(
    st.one_of(
        ADD,
        ADD,
        STEP,
        STEP,
        STEP,
        st.tuples(st.sampled_from(["finish", "abort", "preempt"]), st.integers(0, 99)),
        st.tuples(st.just("unload"), st.integers(1, 2)),
        st.tuples(st.just("flush")),
    ),
    min_size=10,
    max_size=80,
)


@seed(20261201)
@settings(max_examples=150, deadline=None)
@given(events=EVENTS, num_blocks=st.integers(8, 24), max_new=st.integers(1, 6))
def test_page_invariants_hold_under_random_events(events, num_blocks, max_new):
    alloc = BlockAllocator(num_blocks, BLOCK)
    cache = PrefixCache(alloc)
    config = SchedulerConfig(max_running_requests=4, max_num_batched_tokens=16)
    sched = Scheduler(config, alloc, _AnySlot(), cache)
    live: list[Request] = []
    ids = 0
    for event in events:
        kind = event[0]
        if kind == "add":
            _, p, a, suffix = event
            prompt = PREFIXES[p] + suffix
            if alloc.blocks_needed(len(prompt) + max_new, 0) <= num_blocks:  # the engine refuses larger ones
                req = Request(f"r{ids}", prompt, SamplingParams(max_new_tokens=max_new), ADAPTERS[a])
                ids += 1
                live.append(req)
                sched.add(req)
        elif kind == "step":
            batch, failed = sched.schedule()
            for req in failed + _forward(sched, batch, event[1], max_new):
                sched.remove(req)
                live.remove(req)
        elif kind in ("finish", "abort") and live:
            req = live.pop(event[1] % len(live))  # finish: a running one may end at any step, like abort
            sched.remove(req)
        elif kind == "preempt" and sched.running:
            sched._preempt(sched.running[event[1] % len(sched.running)])
        elif kind == "unload":
            cache.drop_adapter(event[1])
        elif kind == "flush" and not live:
            cache.flush()
            assert cache.num_cached_pages == 0 and alloc.num_free == num_blocks
        _check(sched, alloc, cache, live)
    for req in list(live):
        sched.remove(req)
    _check(sched, alloc, cache, [])
    assert all(c == 0 for c in alloc.refcount), "refcounts did not return to zero"
    assert alloc.num_free == num_blocks  # every page is free or an unreferenced cached page


def test_cached_pages_are_evicted_only_when_the_allocator_needs_them():
    alloc = BlockAllocator(6, BLOCK)
    cache = PrefixCache(alloc)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32), alloc, _AnySlot(), cache)
    first = Request("r0", list(range(1, 13)), SamplingParams(max_new_tokens=1), None)  # 3 full pages
    sched.add(first)
    batch, _ = sched.schedule()
    _forward(sched, batch, 50, 1)
    pages = list(first.blocks[:3])
    sched.remove(first)
    assert cache.num_cached_pages == 3 and alloc.num_cached_unreferenced == 3 and alloc.num_free == 6
    second = Request("r1", list(range(1, 13)) + [70], SamplingParams(max_new_tokens=1), None)
    sched.add(second)
    sched.schedule()
    assert second.num_computed == 12 and second.blocks[:3] == pages  # a hit: prefill starts at token 12
    assert [alloc.refcount[b] for b in second.blocks[:3]] == [1, 1, 1]
    sched.remove(second)
    small = Request("s", [90, 91, 92, 93, 94], SamplingParams(), None)  # 2 pages: the 3 free ones suffice
    sched.add(small)
    sched.schedule()
    assert cache.num_cached_pages == 3 and not set(small.blocks) & set(pages)
    sched.remove(small)
    # Three requests of unrelated tokens need all six pages: the cached ones go, least recently used first.
    others = [
        Request(f"o{i}", [100 + 10 * i + j for j in range(7)], SamplingParams(), None) for i in range(3)
    ]
    for req in others:
        sched.add(req)
    sched.schedule()
    assert sum(len(r.blocks) for r in others) == 6 and cache.num_cached_pages == 0
    _check(sched, alloc, cache, others)
