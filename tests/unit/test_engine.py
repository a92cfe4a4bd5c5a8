"""Engine behaviour on a tiny model: LoRA-aware admission, sampling, streaming, abort, validation errors."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint

import mmlora

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    base = make_checkpoint(root / "base", "llama")
    adapters = {
        f"a{i}": make_adapter(base, root / f"a{i}", seed=i, r=4, lora_alpha=8, target_modules=ALL_SEVEN)
        for i in range(4)
    }
    return base, adapters


def engine(tiny, **kw):
    base, adapters = tiny
    opts = dict(
        model=str(base), lora_paths={n: str(p) for n, p in adapters.items()}, device="cpu", dtype="float32"
    )
    opts.update(kw)
    return mmlora.Engine(**opts)


def test_batch_never_holds_more_adapters_than_slots_and_fifo(tiny):
    eng = engine(tiny, max_loras_per_batch=2)
    order = ["a0", "a1", "a2", None, "a3", "a0", None]
    rids = [eng.add_request("Hello world", sampling_params=GREEDY, lora=name) for name in order]
    first_scheduled: dict[str, int] = {}
    step = 0
    resident, loads = [None, None], 0  # slot contents seen after each step: an oracle for slot loads
    while eng.has_unfinished():
        assert step < 500, "7 requests of 6 tokens did not finish within 500 steps"
        running = [r for r in eng.scheduler.running if r.lora is not None]
        assert len({r.lora.uid for r in running}) <= 2
        for out in eng.step():
            first_scheduled.setdefault(out.request_id, step)
        for r in eng.scheduler.running:
            first_scheduled.setdefault(r.rid, step)
            if r.lora is not None:
                assert eng.lora.slot_of(r.lora) == r.slot  # its slot really holds its adapter
        now = list(eng.lora._pool.slot_uid)  # a slot loaded in a step holds a busy adapter till its end
        loads += sum(u is not None and u != before for before, u in zip(resident, now))
        resident = now
        step += 1
    assert eng.stats()["lora_slot_loads_total"] == loads >= 4  # four adapters through two slots
    adapter_rids = [rid for rid, name in zip(rids, order) if name is not None]
    starts = [first_scheduled[rid] for rid in adapter_rids]
    assert starts == sorted(starts)  # adapters are served in arrival order
    base_rids = [rid for rid, name in zip(rids, order) if name is None]
    assert first_scheduled[base_rids[0]] == 0  # base-only requests need no slot and do not wait
    assert eng.lora.entry("a0").refcount == 0 and eng.kv_cache.allocator.usage == 0.0


def test_results_do_not_depend_on_slots_or_batching(tiny):
    prompts = ["Hello world", "The quick brown fox", "Paris is", "0123"]
    loras = ["a0", "a1", None, "a2"]
    wide = engine(tiny, max_loras_per_batch=4).generate(prompts, loras, sampling_params=GREEDY)
    narrow = engine(tiny, max_loras_per_batch=1, max_num_batched_tokens=16).generate(
        prompts, loras, sampling_params=GREEDY
    )
    assert [o.output_ids for o in wide] == [o.output_ids for o in narrow]
    assert len({tuple(o.output_ids) for o in wide}) > 1


def test_interleaved_adapters_run_grouped_and_each_request_gets_its_own_rows(tiny, monkeypatch):
    from mmlora.engine import model_runner

    orders = []

    def spy(sched):
        order = adapter_order(sched)
        orders.append(order)
        return order

    adapter_order = model_runner.adapter_order
    monkeypatch.setattr(model_runner, "adapter_order", spy)
    prompts = ["Hello world", "The quick brown fox", "Paris is", "0123", "jumps over", "a b c d e"]
    loras = ["a0", "a1", "a0", None, "a1", "a0"]
    batched = engine(tiny, max_loras_per_batch=4, max_num_batched_tokens=24).generate(
        prompts, loras, sampling_params=GREEDY
    )
    assert any(o is not None for o in orders)  # some forward ran reordered
    alone = engine(tiny, max_loras_per_batch=4)
    for prompt, lora, out in zip(prompts, loras, batched):
        assert alone.generate([prompt], [lora], sampling_params=GREEDY)[0].output_ids == out.output_ids


def test_adapter_order_groups_slots_stably_and_leaves_grouped_batches():
    from types import SimpleNamespace

    from mmlora.engine.model_runner import adapter_order
    from mmlora.engine.scheduler import ScheduledBatch

    def batch(*slots):
        return ScheduledBatch([SimpleNamespace(slot=s) for s in slots], [1] * len(slots))

    assert adapter_order(batch(2, -1, 2, 0, -1)) == [1, 4, 3, 0, 2]
    assert adapter_order(batch(3, 3, 1, -1, -1)) is None
    assert adapter_order(batch()) is None


def test_seeded_sampling_is_reproducible_and_params_matter(tiny):
    eng = engine(tiny)
    sp = {"max_new_tokens": 8, "temperature": 1.3, "top_p": 0.9, "top_k": 50, "seed": 11, "ignore_eos": True}
    a = eng.generate(["Hello world"] * 2, sampling_params=sp)
    b = eng.generate(["Hello world"], sampling_params=sp)
    assert a[0].output_ids == a[1].output_ids == b[0].output_ids
    c = eng.generate(["Hello world"], sampling_params={**sp, "seed": 12})
    assert c[0].output_ids != a[0].output_ids
    greedy = eng.generate(["Hello world"], sampling_params={**GREEDY, "max_new_tokens": 8})[0].output_ids
    assert eng.generate(["Hello world"], sampling_params={**sp, "top_k": 1})[0].output_ids == greedy
    n = eng.generate(["Hello world"], sampling_params={**sp, "n": 3})
    assert len(n) == 3 and len({tuple(o.output_ids) for o in n}) > 1


def test_unseeded_sampling_follows_the_engine_seed_not_the_process_rng(tiny):
    sp = {"max_new_tokens": 8, "temperature": 1.3, "ignore_eos": True}
    first = engine(tiny, seed=5).generate(["Hello world"] * 3, sampling_params=sp)
    other = engine(tiny, seed=5)
    torch.rand(1000)  # someone else in the process draws from the global generator
    again = other.generate(["Hello world"] * 3, sampling_params=sp)
    assert [o.output_ids for o in first] == [o.output_ids for o in again]
    assert len({tuple(o.output_ids) for o in first}) > 1  # really sampled


def test_penalties_stop_strings_and_stop_tokens(tiny):
    eng = engine(tiny)
    base = eng.generate(
        ["Hello world"], sampling_params={**GREEDY, "max_new_tokens": 10}, return_logprob=True
    )[0]
    assert len(base.logprobs) == 10 and all(lp <= 0 for lp in base.logprobs)
    rep = eng.generate(
        ["Hello world"], sampling_params={**GREEDY, "max_new_tokens": 10, "repetition_penalty": 5.0}
    )[0]
    assert len(set(rep.output_ids)) >= len(set(base.output_ids))
    stop_tok = base.output_ids[3]
    out = eng.generate(
        ["Hello world"], sampling_params={**GREEDY, "max_new_tokens": 10, "stop_token_ids": [stop_tok]}
    )[0]
    assert out.finish_reason == "stop" and out.matched_stop == stop_tok and out.output_ids[-1] == stop_tok
    if len(base.text) > 4:
        stop = base.text[2:4]
        out = eng.generate(["Hello world"], sampling_params={**GREEDY, "max_new_tokens": 10, "stop": [stop]})[
            0
        ]
        assert out.finish_reason == "stop" and out.matched_stop == stop and stop not in out.text
        assert base.text.startswith(out.text)


def test_min_new_tokens_forbids_the_stop_tokens_as_hf_does(tiny):
    """Before min_new_tokens a stop token cannot be chosen (vLLM's min_tokens, SGLang's min_new_tokens,
    HF's MinNewTokensLengthLogitsProcessor), rather than chosen and then not obeyed. Oracle: HF's generate
    with that token as its end token and the same min_new_tokens; then stop strings wait for it too."""
    from transformers import AutoModelForCausalLM

    base_dir, _ = tiny
    eng = engine(tiny)
    ids = eng.tokenizer("Hello world")["input_ids"]
    free = eng.generate(input_ids=[ids], sampling_params={**GREEDY, "max_new_tokens": 8})[0]
    stop_tok = free.output_ids[0]  # greedy's first choice, so holding it back changes the output
    sp = {**GREEDY, "max_new_tokens": 8, "stop_token_ids": [stop_tok], "min_new_tokens": 3}
    # In one batch with an unconstrained copy of the request: the mask touches only the held row.
    held, unheld = eng.generate(
        input_ids=[ids, ids], sampling_params=[sp, {**sp, "min_new_tokens": 0, "stop_token_ids": []}]
    )
    assert unheld.output_ids == free.output_ids
    hf = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]), max_new_tokens=8, min_new_tokens=3, do_sample=False,
            eos_token_id=[stop_tok], pad_token_id=0,
        )[0, len(ids) :].tolist()  # fmt: skip
    assert held.output_ids == ref
    assert stop_tok not in held.output_ids[:3] and len(held.output_ids) >= 3
    text = eng.generate(input_ids=[ids], sampling_params={**GREEDY, "max_new_tokens": 8})[0].text
    if text:
        out = eng.generate(
            input_ids=[ids],
            sampling_params={**GREEDY, "max_new_tokens": 8, "stop": [text[0]], "min_new_tokens": 4},
        )[0]
        assert len(out.output_ids) >= 4


def test_streaming_increments_add_up_and_abort(tiny):
    eng = engine(tiny)
    pieces = list(eng.stream("Hello world", sampling_params={**GREEDY, "max_new_tokens": 8}, lora="a1"))
    final = pieces[-1]
    assert final.finish_reason == "length"
    assert "".join(p.delta_text for p in pieces) == final.text
    assert sum((p.delta_ids for p in pieces), []) == final.output_ids
    rid = eng.add_request("Hello world", sampling_params={**GREEDY, "max_new_tokens": 50}, lora="a2")
    eng.step()
    eng.abort(rid)
    outs = eng.step()
    assert any(o.request_id == rid and o.finish_reason == "abort" for o in outs)
    assert not eng.has_unfinished() and eng.lora.entry("a2").refcount == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(texts=["a", "b"], lora_paths=["a0"]), "lora_paths: has 1 entries for 2 prompts"),
        (dict(texts=["a"], lora_paths=["nope"]), "unknown adapter 'nope'"),
        (dict(texts=["a"], sampling_params={"temperature": -1}), "temperature"),
        (dict(texts=["a"], sampling_params={"top_p": 0}), "top_p"),
        (dict(texts=["a"], sampling_params={"max_new_tokens": -3}), "max_new_tokens"),
        (dict(texts=["a"], sampling_params={"bogus": 1}), "unknown field"),
        (dict(texts=["a"], sampling_params=[{}, {}]), "sampling_params: has 2 entries"),
        (dict(texts=["a"], images=["x.png"]), "text-only"),
        (dict(texts=[""]), "empty"),
        (dict(texts=["a"], sampling_params={"min_new_tokens": 5, "max_new_tokens": 2}), "min_new_tokens"),
        (dict(texts=["a"], sampling_params={"stop_token_ids": [10**6]}), "stop_token_ids.*vocabulary"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_field(tiny, kwargs, match):
    eng = engine(tiny)
    with pytest.raises(ValueError, match=match):
        eng.generate(**kwargs)
    assert not eng.has_unfinished()
    assert eng.generate(["Hello"], sampling_params=GREEDY)[0].finish_reason == "length"  # still serving


def test_lora_backend_auto_resolves_by_device(tiny):
    from mmlora.backends.registry import resolve_backend_name

    assert resolve_backend_name("auto", "cuda:0") == "triton-auto"
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch-gather"
    assert resolve_backend_name("triton-sgmv", "cpu") == "triton-sgmv"
    eng = engine(tiny)  # the default is "auto": on this CPU engine, torch-gather
    assert eng.config.lora.lora_backend == "auto" and eng.lora_backend == "torch-gather"


def test_config_errors_name_the_option(tiny):
    with pytest.raises(TypeError, match="unknown engine option 'max_lora'"):
        engine(tiny, max_lora=3)
    with pytest.raises(ValueError, match="unknown lora_backend 'fast'.*torch-gather"):
        engine(tiny, lora_backend="fast")
    with pytest.raises(ValueError, match="max_loras_per_batch"):
        engine(tiny, max_loras_per_batch=0)
    with pytest.raises(ValueError, match="rank 4 above max_lora_rank|above"):
        engine(tiny, max_lora_rank=2)
    # Past the model's positions the RoPE tables end: refused at start, not an IndexError per request.
    with pytest.raises(
        ValueError, match=r"max_model_len: 513 is more than the model's max_position_embeddings \(512\)"
    ):
        engine(tiny, max_model_len=513)
    assert engine(tiny, max_model_len=512).max_model_len == 512
    with pytest.raises(ValueError, match="max_model_len: must be >= 2"):
        engine(tiny, max_model_len=0)  # not "unset": 0 used to mean the model's own length


def test_load_unload_and_reused_name(tiny):
    base, adapters = tiny
    eng = engine(tiny, lora_paths=[], max_loras_per_batch=2)
    eng.load_lora("x", str(adapters["a0"]))
    with pytest.raises(ValueError, match="already registered"):
        eng.load_lora("x", str(adapters["a1"]))
    x0 = eng.generate(["Hello world"], ["x"], sampling_params=GREEDY)[0].output_ids
    rid = eng.add_request("Hello world", sampling_params={**GREEDY, "max_new_tokens": 20}, lora="x")
    eng.step()
    eng.unload_lora("x")  # waits for the request in flight
    with pytest.raises(ValueError, match="unknown adapter .* being unloaded"):
        eng.add_request("Hello", sampling_params=GREEDY, lora="x")
    assert "x" in [e["name"] for e in eng.list_loras()]
    finished = {}
    for _ in range(500):  # a deadline in steps: 20 tokens need far fewer
        finished.update({o.request_id: o for o in eng.step() if o.finished})
        if not eng.has_unfinished():
            break
    assert not eng.has_unfinished(), "a 20-token request did not finish within 500 steps"
    assert finished[rid].finish_reason == "length" and len(finished[rid].output_ids) == 20  # not cut short
    assert eng.list_loras() == [] and eng.lora.slots_used == 0 and not eng.lora._pool.host
    eng.load_lora("x", str(adapters["a1"]))  # the name again, another adapter: no stale state
    x1 = eng.generate(["Hello world"], ["x"], sampling_params=GREEDY)[0].output_ids
    y1 = (
        engine(tiny, max_loras_per_batch=2)
        .generate(["Hello world"], ["a1"], sampling_params=GREEDY)[0]
        .output_ids
    )
    assert x1 == y1 and x0 != x1
    by_path = eng.generate(["Hello world"], [str(adapters["a0"])], sampling_params=GREEDY)[0].output_ids
    assert by_path == x0


def test_a_registered_adapter_takes_a_free_slot_and_never_evicts_one(tiny):
    """Loading an adapter also loads it into free device pages, so its first request finds it resident;
    with every slot held, loading evicts nothing and the adapter's request loads it as before."""
    base, adapters = tiny
    eng = engine(tiny, lora_paths=[], max_loras_per_batch=2)
    eng.load_lora("x", str(adapters["a0"]))
    eng.load_lora("y", str(adapters["a1"]))
    assert eng.lora.slots_used == 2 and eng.stats()["lora_slot_loads_total"] == 2
    eng.load_lora("z", str(adapters["a2"]))  # no free slot: x and y stay
    assert eng.lora.slot_of(eng.lora.entry("z")) is None
    assert {eng.lora.slot_of(eng.lora.entry(n)) for n in "xy"} == {0, 1}
    got = eng.generate(["Hello world"] * 2, ["x", "y"], sampling_params=GREEDY)
    assert eng.stats()["lora_slot_loads_total"] == 2  # both were resident
    got += eng.generate(["Hello world"], ["z"], sampling_params=GREEDY)
    assert eng.stats()["lora_slot_loads_total"] == 3 and eng.lora.slot_of(eng.lora.entry("z")) is not None
    fresh = engine(tiny, max_loras_per_batch=1)  # one slot: every adapter loaded by its request
    want = fresh.generate(["Hello world"] * 3, ["a0", "a1", "a2"], sampling_params=GREEDY)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]


@pytest.mark.parametrize("n_prompt, n_out", [(5, 0), (5, 3), (1, 4), (0, 2)])
def test_token_slice_and_token_at_match_the_joined_ids(n_prompt, n_out):
    """The eager step's and the graph runner's reads of a request's tokens, against ``all_ids`` itself."""
    from mmlora.engine.request import Request
    from mmlora.engine.sampling_params import SamplingParams

    req = Request("r", list(range(100, 100 + n_prompt)), SamplingParams(), None)
    req.output_ids = list(range(200, 200 + n_out))
    joined = req.all_ids
    for start in range(len(joined) + 1):
        for stop in range(start, len(joined) + 1):
            assert req.token_slice(start, stop) == joined[start:stop]
    assert [req.token_at(p) for p in range(len(joined))] == joined


def test_a_pool_paged_by_rank_tile_gives_the_unpaged_pools_tokens(tmp_path):
    """lora_page_rank=4 in a rank-8 pool: adapters of rank 4 (one page), 8 (two) and 6 (a page and a
    part) give the tokens of the unpaged pool, in one mixed batch with base rows."""
    base = make_checkpoint(tmp_path / "base", "llama")
    paths = {
        f"r{r}": str(
            make_adapter(base, tmp_path / f"r{r}", seed=r, r=r, lora_alpha=8, target_modules=ALL_SEVEN)
        )
        for r in (4, 6, 8)
    }
    prompts = ["Hello world", "The quick brown fox", "Paris is", "0123"]
    loras = ["r4", "r8", None, "r6"]
    outs = []
    for page_rank in (None, 4, 8):  # unset (unpaged on CPU), pages of 4, the pool rank (unpaged)
        eng = mmlora.Engine(
            model=str(base), lora_paths=paths, device="cpu", dtype="float32", max_lora_rank=8,
            lora_page_rank=page_rank,
        )  # fmt: skip
        outs.append([o.output_ids for o in eng.generate(prompts, loras, sampling_params=GREEDY)])
        A = next(iter(eng.lora._pool.buffers.values()))[0]
        assert eng.lora_page_rank == (4 if page_rank == 4 else None)
        assert A.dim() == (4 if page_rank == 4 else 3)
        if page_rank == 4:
            assert A.shape[1] == 2  # two pages of 4 ranks a slot
    assert outs[0] == outs[1] == outs[2]
    assert len({tuple(ids) for ids in outs[0]}) > 1


def test_a_paged_pool_serves_more_small_adapters_at_once(tmp_path):
    """Room for 2 adapters of rank 8 in pages of 4: four rank-4 adapters run in one batch (an unpaged
    pool of the same memory serves them two at a time), with the same tokens."""
    base = make_checkpoint(tmp_path / "base", "llama")
    names = [f"a{i}" for i in range(4)]
    paths = {
        n: str(make_adapter(base, tmp_path / n, seed=i, r=4, lora_alpha=8, target_modules=ALL_SEVEN))
        for i, n in enumerate(names)
    }
    prompts = ["Hello world", "The quick brown fox", "Paris is", "0123"]
    outs, most = [], []
    for page_rank in (None, 4):
        eng = mmlora.Engine(
            model=str(base), lora_paths=paths, device="cpu", dtype="float32", max_lora_rank=8,
            max_loras_per_batch=2, lora_page_rank=page_rank,
        )  # fmt: skip
        rids = [eng.add_request(p, sampling_params=GREEDY, lora=n) for p, n in zip(prompts, names)]
        seen, done = 0, {}
        for _ in range(200):
            if not eng.has_unfinished():
                break
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.output_ids
            seen = max(seen, len({r.lora.uid for r in eng.scheduler.running if r.lora is not None}))
        outs.append([done[r] for r in rids])
        most.append(seen)
    assert most == [2, 4]
    assert outs[0] == outs[1]
