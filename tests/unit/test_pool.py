"""Adapter pool invariants: LRU slots, pinning, busy adapters never evicted, host cache bounds, drops, batch
info segments and the slot counters."""

from __future__ import annotations

import pytest
import torch
from pool_adapters import (
    adapter,
    make_pool,
)

from mmlora.forward.lora import LoRABatchInfo
from mmlora.lora.adapter import LoRAModuleWeights


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
