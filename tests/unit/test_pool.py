"""Adapter pool invariants: LRU slots, pinning, busy adapters never evicted, host cache bounds, drops, and
the one-block upload (an adapter staged in one flat host block) filling slots as the copy per tensor does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmlora.forward.lora import LoRABatchInfo
from mmlora.lora import staging as staging_module
from mmlora.lora.adapter import LoadedAdapter, LoRAModuleWeights
from mmlora.lora.pages import resolve_page_rank
from mmlora.lora.pool import LoRAPool
from mmlora.lora.spec import LoRAModelSpec, LoRATarget
from mmlora.lora.staging import flatten as _flatten
from mmlora.lora.staging import pinned as _pinned

SPEC = LoRAModelSpec(
    num_layers=2,
    targets=(
        LoRATarget("qkv_proj", ("q_proj", "k_proj", "v_proj"), 8, (8, 4, 4)),
        LoRATarget("o_proj", ("o_proj",), 8, (8,)),
    ),
    layers_prefix="model.layers",
    module_parents={
        "q_proj": "self_attn",
        "k_proj": "self_attn",
        "v_proj": "self_attn",
        "o_proj": "self_attn",
    },
)


def adapter(rank: int, value: float) -> LoadedAdapter:
    weights = {}
    for layer in range(2):
        weights[(layer, "qkv_proj")] = LoRAModuleWeights(
            A=(torch.full((rank, 8), value), None, torch.full((rank, 8), -value)),
            B=(torch.full((8, rank), value), None, torch.full((4, rank), value)),
            scalings=(2.0, 0.0, 0.5),
        )
    return LoadedAdapter(path=f"/a/{value}", rank=rank, weights=weights, config={}, nbytes=0)


def make_pool(
    slots: int = 2, max_loaded: int | None = None, device: str = "cpu"
) -> tuple[LoRAPool, LoRABatchInfo]:
    info = LoRABatchInfo(16, slots, device)
    pool = LoRAPool(SPEC, slots, 4, max_loaded, torch.float32, torch.device(device), info.set_slot_rank)
    return pool, info


def test_slot_contents_match_adapter_and_padding_is_zero():
    pool, info = make_pool()
    pool.put_host(1, adapter(2, 1.5), set())
    slot = pool.acquire_slot(1, set())
    A, B, s = pool.buffers[(0, "qkv_proj")]
    assert torch.equal(A[slot, 0:2], torch.full((2, 8), 1.5))
    assert A[slot, 2:4].abs().sum() == 0  # rank padding
    assert A[slot, 4:8].abs().sum() == 0  # untouched k slice
    assert torch.equal(A[slot, 8:10], torch.full((2, 8), -1.5))
    assert torch.equal(B[slot, 0:8, :2], torch.full((8, 2), 1.5)) and B[slot, :, 2:].abs().sum() == 0
    assert B[slot, 8:12].abs().sum() == 0 and torch.equal(B[slot, 12:16, :2], torch.full((4, 2), 1.5))
    assert s[slot].tolist() == [2.0, 0.0, 0.5]
    assert pool.buffers[(0, "o_proj")][0][slot].abs().sum() == 0  # module the adapter does not touch
    assert info.ranks_host[slot] == 2 and int(info.ranks[slot]) == 2


def test_a_reused_slot_holds_only_the_new_adapter():
    """Weights and scalings of every layer come from the adapter last written (one host tensor feeds all
    scalings); modules it leaves out are zero, whatever the slot held before."""
    pool, _ = make_pool(slots=1)
    old = adapter(4, 3.0)
    old.weights[(1, "o_proj")] = LoRAModuleWeights(
        A=(torch.full((4, 8), 3.0),), B=(torch.full((8, 4), 3.0),), scalings=(7.0,)
    )
    pool.put_host(1, old, set())
    pool.acquire_slot(1, set())
    new = adapter(2, 1.5)
    for layer in range(2):  # distinct scalings per layer, to catch a misrouted one
        w = new.weights[(layer, "qkv_proj")]
        new.weights[(layer, "qkv_proj")] = LoRAModuleWeights(w.A, w.B, (2.0 + layer, 0.0, 0.5 + layer))
    pool.put_host(2, new, set())
    slot = pool.acquire_slot(2, set())
    for layer in range(2):
        A, B, s = pool.buffers[(layer, "qkv_proj")]
        assert s[slot].tolist() == [2.0 + layer, 0.0, 0.5 + layer]
        assert torch.equal(A[slot, 0:2], torch.full((2, 8), 1.5)) and A[slot, 2:4].abs().sum() == 0
        assert torch.equal(B[slot, 12:16, :2], torch.full((4, 2), 1.5)) and B[slot, :, 2:].abs().sum() == 0
    A, B, s = pool.buffers[(1, "o_proj")]
    assert A[slot].abs().sum() == 0 and B[slot].abs().sum() == 0 and s[slot].abs().sum() == 0


def test_lru_eviction_never_takes_busy_or_pinned():
    pool, _ = make_pool(slots=2)
    for uid in (1, 2, 3):
        pool.put_host(uid, adapter(2, float(uid)), set())
    s1 = pool.acquire_slot(1, set())
    s2 = pool.acquire_slot(2, set())
    pool.acquire_slot(1, set())  # 1 is now the most recently used
    assert pool.acquire_slot(3, busy={1, 2}) is None  # both in the running batch
    assert not pool.can_get_slot(3, busy={1, 2})
    s3 = pool.acquire_slot(3, busy=set())
    assert s3 == s2 and pool.slot_of(2) is None and pool.slot_of(1) == s1  # LRU victim was 2
    pool.pinned.add(3)
    pool.put_host(2, adapter(2, 2.0), set())
    assert pool.acquire_slot(2, busy={1}) is None  # 3 pinned, 1 busy
    assert pool.acquire_slot(2, busy=set()) == s1  # evicts 1, never the pinned 3


def test_drop_frees_slot_and_host_copy_and_zeroes():
    pool, info = make_pool()
    pool.put_host(7, adapter(3, 1.0), set())
    slot = pool.acquire_slot(7, set())
    pool.drop(7)
    assert pool.slot_of(7) is None and not pool.in_host(7) and pool.slots_used == 0
    assert all(t[slot].abs().sum() == 0 for bufs in pool.buffers.values() for t in bufs)
    assert info.ranks_host[slot] == 0


def test_host_cache_lru_respects_protected_pinned_and_resident():
    pool, _ = make_pool(slots=2, max_loaded=2)
    pool.put_host(1, adapter(1, 1.0), set())
    pool.put_host(2, adapter(1, 2.0), set())
    pool.acquire_slot(1, set())  # resident in a slot: never evicted from host
    pool.put_host(3, adapter(1, 3.0), protected=set())
    assert pool.in_host(1) and not pool.in_host(2) and pool.in_host(3)
    pool.put_host(4, adapter(1, 4.0), protected={3})  # 3 has requests in flight
    assert (
        pool.in_host(3) and pool.in_host(4) and len(pool.host) == 3
    )  # over the bound rather than evict in-use


@pytest.mark.parametrize("slots", [1, 3])
def test_batch_info_fill_segments(slots):
    info = LoRABatchInfo(32, slots, "cpu")
    info.set_slot_rank(0, 4)
    info.fill([3, 2, 1, 0, 4, 2], [0, 0, -1, 0, -1, 0])  # adjacent equal slots merge; empty rows vanish
    assert info.num_tokens == 12 and info.num_segments == 3
    assert info.seg_indptr[:4].tolist() == [0, 5, 10, 12] and info.seg_lens_host == [5, 5, 2]
    assert info.weight_indices[:4].tolist() == [0, -1, 0, -1]
    assert info.token_slots[:13].tolist() == [0] * 5 + [-1] * 5 + [0, 0, -1]
    assert info.max_rank == 4
    with pytest.raises(ValueError, match="slot"):
        info.fill([1], [slots])


def test_slot_loads_count_copies_into_slots_not_hits_or_refusals():
    pool, _ = make_pool(slots=2)
    for uid in (1, 2, 3):
        pool.put_host(uid, adapter(2, float(uid)), set())
    pool.acquire_slot(1, set())  # load
    pool.acquire_slot(2, set())  # load
    pool.acquire_slot(1, set())  # already resident: no load
    assert pool.acquire_slot(3, busy={1, 2}) is None  # refused: no load
    pool.acquire_slot(3, set())  # load, evicting 2
    pool.acquire_slot(2, set())  # load again: churn
    assert pool.slot_loads == 4


def test_slot_padding_fraction_counts_what_adapters_leave_empty():
    """The pool's padding share against a count of the non-zero elements in the occupied slots."""
    pool, _ = make_pool(slots=3)
    assert pool.slot_padding_fraction() == 0.0
    for uid, rank in ((1, 2), (2, 4)):
        pool.put_host(uid, adapter(rank, 1.5), set())
        pool.acquire_slot(uid, set())

    def nonzero_share() -> float:
        occupied = [s for s, u in enumerate(pool.slot_uid) if u is not None]
        filled = total = 0
        for A, B, _ in pool.buffers.values():
            for t in (A, B):
                filled += int(t[occupied].count_nonzero())
                total += t[occupied].numel()
        return 1 - filled / total

    assert pool.slot_padding_fraction() == pytest.approx(nonzero_share())
    # Rank 2 in rank-4 slots, q and v of qkv only: 112 of 448 elements filled; rank 4: 224 of 448.
    assert pool.slot_padding_fraction() == pytest.approx(1 - (112 + 224) / (2 * 448))
    pool.drop(2)
    assert pool.slot_padding_fraction() == pytest.approx(0.75) == pytest.approx(nonzero_share())


def mixed_rank_adapter(b_dtype: torch.dtype = torch.float32) -> LoadedAdapter:
    """Random weights at ranks below the pool's 4 (strided B slot views) and at 4 (contiguous ones), a
    slice left out, a module left out, and modules listed in another order than the pool's."""
    gen = torch.Generator().manual_seed(0)

    def module(ranks: tuple[int | None, ...], outs: tuple[int, ...]) -> LoRAModuleWeights:
        A = tuple(None if r is None else torch.randn(r, 8, generator=gen) for r in ranks)
        B = tuple(
            None if r is None else torch.randn(o, r, generator=gen).to(b_dtype) for r, o in zip(ranks, outs)
        )
        return LoRAModuleWeights(A, B, tuple(0.0 if r is None else 1.0 + r for r in ranks))

    weights = {
        (1, "qkv_proj"): module((2, 4, 1), (8, 4, 4)),
        (0, "o_proj"): module((4,), (8,)),
        (0, "qkv_proj"): module((1, None, 3), (8, 4, 4)),
    }
    return LoadedAdapter(path="/a/mixed", rank=4, weights=weights, config={}, nbytes=0)


def expected_slot(adapter: LoadedAdapter, R: int) -> dict[tuple[int, str], list[torch.Tensor]]:
    """The slot ``adapter`` should fill, built from its tensors: zeros wherever it has none."""
    out = {}
    for layer in range(SPEC.num_layers):
        for t in SPEC.targets:
            n = len(t.slices)
            A, B = torch.zeros(n * R, t.in_features), torch.zeros(sum(t.out_features), R)
            s = torch.zeros(n)
            w = adapter.weights.get((layer, t.name))
            row = 0
            for i in range(n):
                if w is not None and w.A[i] is not None:
                    r = w.A[i].shape[0]
                    A[i * R : i * R + r] = w.A[i].float()
                    B[row : row + t.out_features[i], :r] = w.B[i].float()
                    s[i] = w.scalings[i]
                row += t.out_features[i]
            out[(layer, t.name)] = [A, B, s]
    return out


def assert_slot_is(pool: LoRAPool, slot: int, expected: dict[tuple[int, str], list[torch.Tensor]]) -> None:
    for key, bufs in pool.buffers.items():
        for buf, want in zip(bufs, expected[key]):
            assert torch.equal(buf[slot], want), key


def test_flattened_adapter_is_views_of_one_block():
    adapter = mixed_rank_adapter()
    flat = _flatten(adapter, pin=False)
    assert len(flat.staged) == 1  # a small adapter fits one block
    assert flat is not None and flat.staged is not None and adapter.staged is None
    pairs = [
        (t, f)
        for key, w in adapter.weights.items()
        for t, f in zip((*w.A, *w.B), (*flat.weights[key].A, *flat.weights[key].B))
    ]
    assert flat.staged[0].numel() == sum(t.numel() for t, _ in pairs if t is not None)
    for t, f in pairs:
        assert (t is None) == (f is None)
        if t is not None:
            assert (
                torch.equal(t, f)
                and f.untyped_storage().data_ptr() == flat.staged[0].untyped_storage().data_ptr()
            )
    assert [w.scalings for w in flat.weights.values()] == [w.scalings for w in adapter.weights.values()]


def count_plan_builds(monkeypatch) -> list[int]:
    """Spy on UploadPlan.build: one entry (the pair count) per plan built."""
    calls: list[int] = []
    build = staging_module.UploadPlan.build.__func__

    def spy(cls, pairs, *rest):  # noqa: ANN001, ANN002, ANN202
        calls.append(len(pairs))
        return build(cls, pairs, *rest)

    monkeypatch.setattr(staging_module.UploadPlan, "build", classmethod(spy))
    return calls


@pytest.mark.parametrize("block_bytes", [staging_module.STAGE_BLOCK_BYTES, 64])
def test_staged_slot_write_matches_per_tensor_write(monkeypatch, block_bytes):
    """The blocked upload (through a staging tensor, by offsets into the blocks) fills a slot exactly as
    the copy per tensor does, over a slot that held another adapter; 64-byte blocks: several blocks,
    and tensors larger than a block in blocks of their own."""
    monkeypatch.setattr(staging_module, "STAGE_BLOCK_BYTES", block_bytes)
    calls = count_plan_builds(monkeypatch)
    pool, info = make_pool(slots=3)
    mixed = mixed_rank_adapter()
    flat = _flatten(mixed, pin=False)
    pool.write_slot(0, adapter(4, 9.0))
    pool.write_slot(0, flat)
    assert calls == [12]  # the 6 slices with weights, A and B each, in one plan
    pool.write_slot(1, mixed)
    assert calls == [12]  # unstaged: copies per tensor
    pool.write_slot(2, flat)  # another slot: its own plan, on the pool's staging buffer
    assert calls == [12, 12]
    expected = expected_slot(mixed, pool.max_rank)
    for slot in range(3):
        assert_slot_is(pool, slot, expected)
    assert pool._slot_filled[0] == pool._slot_filled[1] == sum(b.numel() for b in flat.staged)
    assert (len(flat.staged) > 2) == (block_bytes == 64)
    assert info.ranks_host[0] == info.ranks_host[1] == 4


def scaled(adapter: LoadedAdapter, factor: float) -> LoadedAdapter:
    """The same modules and shapes with other values (so the same staged layout)."""
    weights = {
        key: LoRAModuleWeights(
            A=tuple(None if t is None else t * factor for t in w.A),
            B=tuple(None if t is None else t - factor for t in w.B),
            scalings=tuple(s * factor for s in w.scalings),
        )
        for key, w in adapter.weights.items()
    }
    return dataclasses.replace(adapter, weights=weights, path=f"{adapter.path}*{factor}")


def test_upload_plans_are_reused_per_slot_and_layout_and_rebuilt_after_the_staging_buffer_grows(monkeypatch):
    """Adapters staged alike replay one plan per slot, each upload copying its own weights (the oracle:
    the slot built from its own tensors); a larger adapter grows the staging buffer, whose old views the
    plans held, so the next upload builds its plan again and is still right."""
    calls = count_plan_builds(monkeypatch)
    pool, _ = make_pool(slots=2)
    first, second = (_flatten(scaled(mixed_rank_adapter(), f), pin=False) for f in (1.0, -3.0))
    assert first.staged_layout == second.staged_layout is not None
    for upload in (first, second, first, second):
        pool.write_slot(0, upload)
        assert_slot_is(pool, 0, expected_slot(upload, pool.max_rank))
    assert calls == [12]
    pool.write_slot(1, second)
    assert calls == [12, 12]
    bigger = _flatten(adapter(4, 2.5), pin=False)  # 4 x (8 + 8 + 8 + 4) x 2 layers: more than mixed
    assert bigger.staged_layout != first.staged_layout
    assert sum(b.numel() for b in bigger.staged) > sum(b.numel() for b in first.staged)
    pool.write_slot(1, bigger)
    assert_slot_is(pool, 1, expected_slot(bigger, pool.max_rank))
    pool.write_slot(0, first)
    assert calls == [12, 12, 8, 12]  # slot 0's plan was dropped with the old buffer
    assert_slot_is(pool, 0, expected_slot(first, pool.max_rank))


def test_the_first_adapter_of_a_layout_builds_its_plans_at_load_time(monkeypatch):
    """Plans for every slot are built when a layout's first adapter enters the host cache, so slot loads
    in a step (a batch admitting many adapters) only replay them; each load still copies its own
    adapter (the oracle: the slot built from its tensors)."""
    calls = count_plan_builds(monkeypatch)
    pool, _ = make_pool(slots=3)
    adapters = [_flatten(scaled(mixed_rank_adapter(), f), pin=False) for f in (1.0, 2.0, -0.5, 4.0)]
    for uid, a in enumerate(adapters):
        pool.put_host(uid, a, set())
    assert calls == [12, 12, 12]  # at the first adapter's load, one per slot
    for uid in range(4):
        slot = pool.acquire_slot(uid, busy=set())
        assert_slot_is(pool, slot, expected_slot(adapters[uid], pool.max_rank))
    assert calls == [12, 12, 12] and pool.slot_loads == 4


def test_an_adapter_filling_its_whole_slot_overwrites_every_element():
    """A rank-4 adapter on every slice of every module fills a rank-4 slot entirely, so its upload skips
    zeroing the slot first; nothing of the slot's previous adapter may remain."""
    gen = torch.Generator().manual_seed(3)
    weights = {
        (layer, t.name): LoRAModuleWeights(
            A=tuple(torch.randn(4, t.in_features, generator=gen) for _ in t.slices),
            B=tuple(torch.randn(o, 4, generator=gen) for o in t.out_features),
            scalings=(1.5,) * len(t.slices),
        )
        for layer in range(SPEC.num_layers)
        for t in SPEC.targets
    }
    full = _flatten(LoadedAdapter(path="/a/full", rank=4, weights=weights, config={}, nbytes=0), pin=False)
    pool, _ = make_pool()
    pool.write_slot(0, _flatten(mixed_rank_adapter(), pin=False))
    pool.write_slot(0, full)
    assert pool._slot_filled[0] == pool._page_elems  # an unpaged slot is one page
    assert_slot_is(pool, 0, expected_slot(full, pool.max_rank))


def test_mixed_dtypes_fall_back_to_a_pinned_copy_per_tensor(monkeypatch):
    mixed = mixed_rank_adapter(b_dtype=torch.bfloat16)
    assert _flatten(mixed, pin=False) is None
    pinned = []

    def fake_pin(t: torch.Tensor) -> torch.Tensor:  # no CUDA here: record the call, copy
        pinned.append(t)
        return t.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    host = _pinned(mixed)
    assert host.staged is None and len(pinned) == 12
    for key, w in mixed.weights.items():
        for t, h in zip((*w.A, *w.B), (*host.weights[key].A, *host.weights[key].B)):
            assert (t is None and h is None) or (torch.equal(t, h) and t.dtype == h.dtype)
    pool, _ = make_pool()
    pool.write_slot(0, host)
    assert_slot_is(pool, 0, expected_slot(mixed, pool.max_rank))


def test_staged_write_refuses_tensors_outside_the_block():
    """An adapter whose tensors were replaced but kept the old block would upload stale weights: refused
    when it has no layout id (a plan is built and checked), and when it kept one whose plan is cached."""
    mixed = mixed_rank_adapter()
    flat = _flatten(mixed, pin=False)
    pool, _ = make_pool()
    with pytest.raises(ValueError, match="staged blocks hold it"):
        pool.write_slot(0, dataclasses.replace(mixed, staged=flat.staged))
    pool.write_slot(0, flat)  # caches slot 0's plan for this layout
    with pytest.raises(ValueError, match="staged blocks hold it"):
        pool.write_slot(0, dataclasses.replace(flat, weights=mixed.weights))


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


def random_adapter(rank: int, seed: int) -> LoadedAdapter:
    """Every slice of qkv_proj in both layers, every element distinct (a copy in the wrong order fails)."""
    g = torch.Generator().manual_seed(seed)
    weights = {
        (layer, "qkv_proj"): LoRAModuleWeights(
            A=tuple(torch.randn(rank, 8, generator=g) for _ in range(3)),
            B=tuple(torch.randn(out, rank, generator=g) for out in (8, 4, 4)),
            scalings=(2.0, 1.0, 0.5),
        )
        for layer in range(2)
    }
    return LoadedAdapter(path=f"/r/{seed}", rank=rank, weights=weights, config={}, nbytes=0)


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
