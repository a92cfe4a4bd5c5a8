"""The one-block upload: an adapter staged in one flat host block fills its slot exactly as the copy per
tensor does, with upload plans built once per slot and layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pool_adapters import (
    SPEC,
    adapter,
    assert_slot_is,
    count_plan_builds,
    expected_slot,
    make_pool,
    mixed_rank_adapter,
)

from mmlora.lora import staging as staging_module
from mmlora.lora.adapter import LoadedAdapter, LoRAModuleWeights
from mmlora.lora.staging import flatten as _flatten
from mmlora.lora.staging import pinned as _pinned


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
