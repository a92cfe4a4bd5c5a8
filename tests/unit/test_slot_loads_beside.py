"""Slot loads beside the forwards (on CUDA they run on an upload stream): a loading slot is not ready,
is never a victim, and is waited for before it is zeroed; a request whose adapter is loading waits while
others run, the first waiting requests' adapters load ahead of their turn, and the tokens are those of
loads made at once. On the CPU the copies happen at once, so completion is simulated: each load's event
reports done only after it has been asked a given number of times."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_pool import adapter, make_pool
from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint

import mmlora


class LaterEvent:
    """A CUDA event stand-in: done after ``queries`` calls of query(), or once synchronized."""

    def __init__(self, queries: int) -> None:
        self.left = queries
        self.synchronized = False

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0 or self.synchronized

    def synchronize(self) -> None:
        self.synchronized = True


def loads_beside(pool, queries: int | list[int]) -> list[tuple[int, LaterEvent]]:
    """Make ``pool`` take the beside-the-forward path with simulated completion (each load done after
    ``queries`` queries, or the next of a list per load); returns its loads."""
    loads: list[tuple[int, LaterEvent]] = []

    def write_beside(slot, loaded):
        pool.write_slot(slot, loaded)
        done = LaterEvent(queries if isinstance(queries, int) else queries[len(loads)])
        pool._loading[slot] = done
        loads.append((slot, done))

    pool.upload_stream = object()  # only checked for None on this path
    pool._write_beside = write_beside
    return loads


def test_a_loading_slot_is_not_ready_not_a_victim_and_settled_before_zeroing():
    pool, _ = make_pool(slots=1)
    loads = loads_beside(pool, queries=[2, 1000])
    pool.put_host(1, adapter(2, 1.0), set())
    pool.put_host(2, adapter(2, 2.0), set())
    slot = pool.acquire_slot(1, set())
    assert [pool.slot_ready(slot) for _ in range(3)] == [False, False, True]
    assert pool.slot_ready(slot)  # stays ready
    pool.acquire_slot(2, set())  # evicts adapter 1 (idle, loaded): adapter 2 now loads into the slot
    assert not pool.slot_ready(slot)
    assert pool.acquire_slot(1, set()) is None  # the only slot is loading: no victim
    assert not pool.can_get_slot(1, set())
    pool.drop(2)  # zeroing the slot waits for its load first
    assert loads[-1][1].synchronized and pool.slot_ready(slot)


def test_a_finished_load_nobody_asked_about_frees_its_slot_for_eviction():
    """A slot whose load is done is reaped when a victim is sought, even if no request asked for it (its
    requests were aborted): it must not stay protected as loading forever."""
    pool, _ = make_pool(slots=1)
    loads_beside(pool, queries=1)
    pool.put_host(1, adapter(2, 1.0), set())
    pool.put_host(2, adapter(2, 2.0), set())
    slot = pool.acquire_slot(1, set())  # nobody calls slot_ready(slot) after this
    assert pool.acquire_slot(2, set()) is None  # its first query: still loading
    assert pool.acquire_slot(2, set()) == slot  # its second: done, so adapter 1 is evicted
    assert pool.slot_uid[slot] == 2


def _engine(base: Path, adapters: dict[str, str]) -> mmlora.Engine:
    # Idle adapters registered first take the three slots (a newly registered adapter is loaded into
    # free pages), so a, b and c are registered but not resident: their requests load them.
    idle = {f"idle-{name}": path for name, path in adapters.items()}
    return mmlora.Engine(
        model=str(base), lora_paths={**idle, **adapters}, max_loras_per_batch=3, max_lora_rank=8,
        dtype="float32", max_running_requests=2, max_num_batched_tokens=64, device="cpu",
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("beside")
    base = make_checkpoint(root / "base", "llama")
    adapters = {
        name: str(make_adapter(base, root / name, seed=i + 1, r=4, lora_alpha=8, target_modules=ALL_SEVEN))
        for i, name in enumerate("abc")
    }
    return base, adapters


def test_requests_wait_for_their_loading_adapters_and_get_the_same_tokens(tiny):
    base, adapters = tiny
    prompts = [[5, 9, 13, 2], [31, 4, 4, 8, 19], [11, 12, 13], [40, 41, 2, 9, 9], [7, 7, 3], [8, 1, 2]]
    loras = [None, "a", "b", None, "c", "a"]
    sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    reference = _engine(base, adapters).generate(input_ids=prompts, lora_paths=loras, sampling_params=sp)

    engine = _engine(base, adapters)
    assert not engine.lora.loads_async  # the CPU loads at once
    loads = loads_beside(engine.lora._pool, queries=3)
    rids = [engine.add_request(input_ids=p, lora=lora, sampling_params=sp) for p, lora in zip(prompts, loras)]
    assert engine.lora.loads_async
    first_token_step: dict[str, int] = {}
    outputs: dict[str, mmlora.RequestOutput] = {}
    for step in range(100):
        for out in engine.step():
            first_token_step.setdefault(out.request_id, step)
            outputs[out.request_id] = out
        if step == 0:
            # a and b started loading when their requests came up; the running cap then ended admission,
            # and c (the next waiting request's adapter) started loading ahead of its turn.
            assert [engine.lora._pool.slot_uid[s] for s, _ in loads] == [
                engine.lora._registry.get(n).uid for n in "abc"
            ]
        if not engine.has_unfinished():
            break
    assert [outputs[r].output_ids for r in rids] == [o.output_ids for o in reference]
    # Step 0 ran the base-only requests while the adapters loaded; adapter requests ran once loaded.
    assert first_token_step[rids[0]] == first_token_step[rids[3]] == 0
    assert min(first_token_step[r] for r in (rids[1], rids[2], rids[4])) > 0
    assert sorted({engine.lora._pool.slot_uid[s] is not None for s, _ in loads}) == [True]
    assert len(loads) == 3  # one load per adapter: a's second request found it resident


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_more_adapters_than_slots_load_each_adapter_no_more_often_than_loads_made_at_once(
    tmp_path_factory, overlap
):
    """Many adapters over few slots: a request whose adapter is loading keeps that slot claimed, so the
    requests after it in the same admission pass do not take it back once the copy is done. Before,
    each started a load evicting the one before it (H200, session 11: the 1000-adapter serving run
    ran for minutes once loads really ran beside the forwards). Here, before, 4 of the 24 requests had not
    run after 400 steps and 1,600 loads; loads made at once need 15."""
    root = tmp_path_factory.mktemp("many")
    base = make_checkpoint(root / "base", "llama")
    names = [f"a{i}" for i in range(10)]
    adapters = {
        n: str(make_adapter(base, root / n, seed=i + 1, r=4, lora_alpha=8, target_modules=["q_proj"]))
        for i, n in enumerate(names)
    }
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (int(torch.randint(3, 9, (1,), generator=rng)),), generator=rng).tolist()
               for _ in range(24)]  # fmt: skip
    loras = [names[int(i)] for i in torch.randint(0, len(names), (24,), generator=rng)]
    sp = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    runs = {}
    for queries in (0, 1, 3):  # 0: every load done when first asked, as loads made at once
        engine = mmlora.Engine(
            model=str(base), lora_paths=adapters, max_loras_per_batch=3, max_lora_rank=8, dtype="float32",
            max_running_requests=6, max_num_batched_tokens=32, device="cpu", overlap_schedule=overlap,
        )  # fmt: skip
        loads = loads_beside(engine.lora._pool, queries=queries)
        rids = [engine.add_request(input_ids=p, lora=lo, sampling_params=sp) for p, lo in zip(prompts, loras)]
        outputs = {}
        for _ in range(400):  # a cascade of loads can starve every request: bounded, not a hang
            outputs.update((o.request_id, o) for o in engine.step() if o.finished)
            if not engine.has_unfinished():
                break
        assert len(outputs) == len(prompts), f"{len(outputs)} of {len(prompts)} finished, {len(loads)} loads"
        runs[queries] = ([outputs[r].output_ids for r in rids], len(loads))
    at_once_tokens, at_once_loads = runs[0]
    assert at_once_loads < len(prompts)
    for queries in (1, 3):
        tokens, n_loads = runs[queries]
        assert tokens == at_once_tokens
        # Loads that finish a step later shift which requests run together: a load or two either way.
        assert n_loads <= at_once_loads + 2, (queries, n_loads, at_once_loads)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_loads_on_the_upload_stream_fill_the_slot_and_keep_tokens(tiny):
    """The real thing: a slot load on the upload stream is ready once its event is done, holds what a
    load on the main stream holds, and an engine loading beside its forwards gives the same tokens."""
    base, adapters = tiny
    pools = {}
    for name, upload_stream in (("beside", torch.cuda.Stream()), ("main", None)):
        pool, _ = make_pool(slots=2, device="cuda")
        pool.upload_stream = upload_stream
        pool.put_host(1, adapter(2, 1.5), set())
        slot = pool.acquire_slot(1, set())
        while not pool.slot_ready(slot):
            pass
        pools[name] = pool
    for key, bufs in pools["main"].buffers.items():
        for mine, theirs in zip(pools["beside"].buffers[key], bufs):
            assert torch.equal(mine, theirs), key
    prompts = [[5, 9, 13, 2], [31, 4, 4, 8, 19], [11, 12, 13], [40, 41, 2, 9, 9]]
    loras = ["a", None, "b", "c"]
    sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    outs = []
    for disable in (True, False):
        engine = mmlora.Engine(
            model=str(base), lora_paths=adapters, max_loras_per_batch=3, max_lora_rank=8,
            dtype="float32", device="cuda", disable_async_uploads=disable,
        )  # fmt: skip
        with engine:  # closed before the next one takes the device's memory
            assert engine.lora.loads_async is not disable
            outs.append(engine.generate(input_ids=prompts, lora_paths=loras, sampling_params=sp))
    assert [o.output_ids for o in outs[0]] == [o.output_ids for o in outs[1]]


@cuda
def test_a_load_beside_a_busy_stream_never_waits_for_it(tiny):
    """Under the overlap scheduler the main stream still runs the launched step while the next step admits
    requests: a slot load on the upload stream must not wait for it (an item assignment into the rank
    table copied from the host and synchronized the stream: 10 ms a load on an H200)."""
    base, adapters = tiny
    with mmlora.Engine(
        model=str(base), lora_paths=adapters, max_loras_per_batch=2, max_lora_rank=8, dtype="float32",
        device="cuda",
    ) as engine:  # fmt: skip
        lora = engine.lora
        assert lora.loads_async
        entry = lora.resolve("c")  # a and b took the two slots when they were registered: c loads here
        assert lora._pool.slot_of(entry.uid) is None
        lora._pool.put_host(entry.uid, lora._read(entry.path), set())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
        try:
            lora.admit(entry, set())
        finally:
            torch.cuda.set_sync_debug_mode(0)
        slot = lora._pool.slot_of(entry.uid)
        torch.cuda.synchronize()
        assert lora._pool.slot_ready(slot) and lora.info.ranks[slot].item() == lora.info.ranks_host[slot] > 0
