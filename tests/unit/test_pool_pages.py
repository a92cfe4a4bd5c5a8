"""The paged pool (S-LoRA's unified paging by rank): slots of pages hold what an unpaged pool holds, small
ranks fit more adapters, and staged uploads into pages copy few strided views."""

from __future__ import annotations

import pytest
import torch
from pool_adapters import (
    SPEC,
    adapter,
    expected_slot,
    make_pool,
    random_adapter,
)

from mmlora.forward.lora import LoRABatchInfo
from mmlora.lora import staging as staging_module
from mmlora.lora.adapter import LoadedAdapter
from mmlora.lora.pages import resolve_page_rank
from mmlora.lora.pool import LoRAPool
from mmlora.lora.staging import flatten as _flatten


def paged_pool(adapters: int = 2) -> tuple[LoRAPool, LoRABatchInfo]:
    """Room for ``adapters`` adapters of rank 4 in pages of 2 ranks (two pages an adapter at most)."""
    info = LoRABatchInfo(16, 2 * adapters, "cpu")
    pool = LoRAPool(
        SPEC, adapters, 4, None, torch.float32, torch.device("cpu"), info.set_slot_rank, page_rank=2
    )
    assert (pool.pages, pool.page_rank, pool.num_slots, pool.max_adapters) == (2, 2, 2 * adapters, adapters)
    return pool, info


def assert_paged_slot_is(pool: LoRAPool, slot: int, adapter: LoadedAdapter) -> None:
    """The slot, read back unpaged over the pages the adapter takes, is what an unpaged pool holds."""
    from mmlora.forward.lora import unpage_a, unpage_b
    from mmlora.lora.pages import pages_for

    pages = pages_for(adapter.rank, 2, 2)
    expected = expected_slot(adapter, 2 * pages)
    for (layer, name), (A, B, s) in pool.buffers.items():
        n = len(next(t for t in SPEC.targets if t.name == name).slices)
        want_a, want_b, want_s = expected[(layer, name)]
        assert torch.equal(unpage_a(A[slot, :pages], n), want_a), (layer, name)
        assert torch.equal(unpage_b(B[slot, :pages]), want_b), (layer, name)
        assert torch.equal(s[slot], want_s)


@pytest.mark.parametrize("rank", [1, 2, 3, 4])
@pytest.mark.parametrize("staged", [False, True])
def test_paged_slots_hold_what_an_unpaged_pool_holds(rank, staged):
    """Ranks within one page (1, 2), whole pages (4) and a rank split over a page and a part (3: copied
    per page, without an upload plan), placed beside another adapter and then over an evicted one."""
    pool, info = paged_pool()
    pool.put_host(1, adapter(4, 9.0), set())
    assert pool.acquire_slot(1, set()) == 0  # pages 0 and 1
    new = adapter(rank, 1.5)
    pool.put_host(2, _flatten(new, pin=False) if staged else new, set())
    slot = pool.acquire_slot(2, set())
    assert slot == 2 and pool.slot_of(1) == 0  # free pages first
    assert_paged_slot_is(pool, slot, new)
    assert info.ranks_host[slot] == rank and info.ranks_host[0] == 4
    filled = sum(t.numel() for w in new.weights.values() for t in (*w.A, *w.B) if t is not None)
    assert pool._slot_filled[slot] == filled
    pool.put_host(3, adapter(4, 2.5), set())
    assert pool.acquire_slot(3, {2}) == 0  # evicts the idle adapter 1, not the busy 2
    assert pool.slot_of(1) is None and info.ranks_host[0] == 4
    assert_paged_slot_is(pool, 0, adapter(4, 2.5))
    assert_paged_slot_is(pool, slot, new)


def test_a_paged_pool_holds_more_adapters_of_small_ranks_and_evicts_to_fit_a_large_one():
    """Room for two rank-4 adapters holds four of rank 2 (no padding); a rank-4 one then takes an aligned
    pair of pages, evicting the least recently used adapters there, never a busy or pinned one."""
    pool, info = paged_pool()
    for uid in range(4):
        pool.put_host(uid, adapter(2, float(uid + 1)), set())
        assert pool.acquire_slot(uid, set()) == uid
    assert pool.slots_used == 4 and pool.slot_padding_fraction() == pytest.approx(0.5)  # k slices empty
    pool.acquire_slot(0, set())  # 0 and 1 used since 2 and 3: the pair 2-3 is older
    pool.acquire_slot(1, set())
    pool.put_host(9, adapter(4, 7.0), set())
    assert pool.can_get_slot(9, set()) and not pool.can_get_slot(9, {0, 2})
    pool.pinned.add(3)
    assert not pool.can_get_slot(9, {0})  # pair 0-1 holds a busy one, pair 2-3 a pinned one
    pool.pinned.discard(3)
    assert pool.acquire_slot(9, set()) == 2
    assert {pool.slot_of(u) for u in range(4)} == {0, 1, None}
    assert info.ranks_host[2] == 4 and info.ranks_host[3] == 0  # page 3 is no adapter's first page now
    assert_paged_slot_is(pool, 2, adapter(4, 7.0))
    pool.drop(9)
    assert info.ranks_host[2] == 0 and pool.buffers[(0, "qkv_proj")][0][2].abs().sum() == 0


@pytest.mark.parametrize(
    ("page_rank", "max_rank", "device", "resolved"),
    [
        (None, 64, "cuda", 16),  # the default pool on CUDA
        (None, 32, "cuda", 16),
        (None, 128, "cuda", 16),
        (None, 16, "cuda", None),  # one page: unpaged
        (None, 8, "cuda", None),
        (None, 48, "cuda", None),  # three pages: not a power of two
        (None, 64, "cpu", None),  # the CPU path stacks live ranks: never paged unless asked
        (64, 64, "cuda", None),  # the pool rank itself: unpaged on request
        (8, 64, "cpu", 8),
        (32, 64, "cuda", 32),
    ],
)
def test_the_page_rank_a_pool_uses(page_rank, max_rank, device, resolved):
    assert resolve_page_rank(page_rank, max_rank, torch.device(device)) == resolved


def test_a_staged_upload_into_pages_copies_few_strided_views():
    """A staged rank-4 adapter in pages of 2: each A view spans two pages of rows and is copied as one
    flat pair per page (in the multi-tensor call); a module's B views, rows back to back, are one strided
    copy; and the slot reads back as the adapter."""
    new = random_adapter(4, 0)
    pool, _ = paged_pool()
    pool.put_host(2, _flatten(new, pin=False), set())
    slot = pool.acquire_slot(2, set())
    assert_paged_slot_is(pool, slot, new)
    plan = pool._uploads.plans[(slot, pool.host[2].staged_layout)]
    assert len(plan.flat[0]) == 2 * 3 * 2 and all(d.dim() == 1 for d in plan.flat[0])  # layers, slices, pages
    assert [d.shape for d in plan.strided[0]] == [(16, 2, 2)] * 2  # a module's B, [out, pages, U], a layer


def test_a_staged_upload_below_the_pool_rank_joins_a_modules_b_views():
    """A staged rank-2 adapter in an unpaged rank-4 pool: B[slot, rows, :2] is strided; the three slices'
    views are one copy a layer, and the slot holds the adapter (zeros past its rank)."""
    new = random_adapter(2, 1)
    pool, _ = make_pool()
    pool.put_host(1, _flatten(new, pin=False), set())
    slot = pool.acquire_slot(1, set())
    expected = expected_slot(new, 4)
    for key, (A, B, s) in pool.buffers.items():
        want_a, want_b, want_s = expected[key]
        assert torch.equal(A[slot], want_a) and torch.equal(B[slot], want_b) and torch.equal(s[slot], want_s)
    plan = pool._uploads.plans[(slot, pool.host[1].staged_layout)]
    assert [d.shape for d in plan.strided[0]] == [(16, 2)] * 2


def test_building_paged_upload_plans_splits_only_a_views_by_page(monkeypatch):
    """Telling the paged A views [pages, U, in] apart splits only those, one part per page: a paged B view
    [out, pages, U] is never split by its rows (with Mistral-7B's 14,336 rows that made a rank-64 upload
    plan take seconds to build, and an H200 run load 32 adapters in 211 s)."""
    new = random_adapter(4, 0)
    pool, _ = paged_pool()
    staged = _flatten(new, pin=False)
    parts: list[int] = []
    unbind = torch.Tensor.unbind

    def counted(self: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, ...]:
        out = unbind(self, dim)
        parts.append(len(out))
        return out

    monkeypatch.setattr(torch.Tensor, "unbind", counted)
    pool.put_host(2, staged, set())  # builds the layout's plan for every slot
    monkeypatch.undo()
    # 2 slots it can start at x 2 layers x 3 slices of A, each split into its 2 pages (and no B view
    # split into its 8 or 4 rows, as before 758bc23)
    assert parts == [2] * (2 * 2 * 3)
    slot = pool.acquire_slot(2, set())
    assert_paged_slot_is(pool, slot, new)


def test_upload_bytes_from_staged_blocks_equal_the_tensors_own():
    from mmlora.bench.breakdown import adapter_upload_bytes

    plain = adapter(4, 1.0)
    staged = staging_module.flatten(plain, pin=False)
    assert staged is not None and staged.staged is not None
    # qkv per layer: A 2 x (4 x 8), B (8 x 4) + (4 x 4), fp32, two layers
    want = 2 * (2 * 4 * 8 + 8 * 4 + 4 * 4) * 4
    assert adapter_upload_bytes(plain) == want
    assert adapter_upload_bytes(staged) == want
