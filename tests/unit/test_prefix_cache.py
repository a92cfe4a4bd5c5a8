"""Prefix cache on tiny Llama and Gemma2: greedy outputs identical with the cache on and off, and keys that
never let two adapters (or two loads of one name) share a page.

The oracle is the same engine configuration with ``disable_radix=True`` (that path is itself checked
against HF + PEFT in tests/models). The workload mixes adapters and base rows over shared system
prompts, runs in 16-token prefill chunks, and is run on a KV cache small enough to force preemption.
"""

from __future__ import annotations

import pytest
from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint, make_gemma2_checkpoint

import mmlora

BLOCK = 4
SYSTEM = {"x": [7 + (i * 37) % 300 for i in range(23)], "y": [11 + (i * 53) % 300 for i in range(18)]}
# (system prompt, user turn, adapter): same system prompt under several adapters and base rows.
ROWS = [
    ("x", [40, 41, 42], "a"),
    ("x", [50, 51], "a"),
    ("x", [40, 41, 42], "b"),
    ("x", [60], None),
    ("y", [70, 71, 72, 73, 74, 75], "b"),
    ("y", [], "b"),  # the system prompt alone: its last page is recomputed, never shared
]
SECOND_TURN = [(s, u + [90, 91], a) for s, u, a in ROWS]  # after the first batch: hits in the cache
SAMPLING = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _adapters(base, root, model_class="AutoModelForCausalLM"):
    kw = {"model_class": model_class}
    return {
        "a": make_adapter(base, root / "a", seed=1, r=4, lora_alpha=8, target_modules=ALL_SEVEN, **kw),
        "b": make_adapter(base, root / "b", seed=2, r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"], **kw),
    }  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-llama")
    base = make_checkpoint(root / "base", "llama")
    return base, _adapters(base, root)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-gemma2")
    base = make_gemma2_checkpoint(root / "base", window=6)
    return base, _adapters(base, root)


def _engine(base, adapters, cache: bool, **kw) -> mmlora.Engine:
    return mmlora.Engine(
        model=str(base), lora_paths={n: str(p) for n, p in adapters.items()}, max_loras_per_batch=2,
        max_lora_rank=4, block_size=BLOCK, device="cpu", dtype="float32", disable_radix=not cache, **kw,
    )  # fmt: skip


def _generate(engine, rows, n: int = 1):
    return engine.generate(
        input_ids=[SYSTEM[s] + u for s, u, _ in rows], lora_paths=[a for _, _, a in rows],
        sampling_params={**SAMPLING, "n": n}, return_logprob=True,
    )  # fmt: skip


def _workload(engine):
    """Two batches (the second hits what the first cached), then n=2 siblings on a fresh system prompt."""
    outs = _generate(engine, ROWS) + _generate(engine, SECOND_TURN)
    siblings = _generate(engine, [("y", [99, 98, 97, 96, 95], "a")], n=2)
    return outs + siblings, engine.stats()


def _assert_same(on, off) -> None:
    for i, (a, b) in enumerate(zip(on, off)):
        assert a.error is None and a.finish_reason == "length", (i, a.error)
        assert a.output_ids == b.output_ids, f"request {i}"
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4), f"request {i}"


@pytest.mark.parametrize(
    ("family", "max_kv_tokens"),
    [("llama", 1024), ("llama", 48), ("gemma2", 48)],
    ids=["roomy", "preempting", "gemma2"],
)
def test_greedy_outputs_identical_with_cache_on_and_off(family, max_kv_tokens, request):
    base, adapters = request.getfixturevalue(family)
    kw = dict(max_kv_tokens=max_kv_tokens, max_num_batched_tokens=16)  # 16-token prefill chunks
    on, on_stats = _workload(_engine(base, adapters, True, **kw))
    off, off_stats = _workload(_engine(base, adapters, False, **kw))
    _assert_same(on, off)
    assert on_stats["prefix_cache_hits_total"] > 0 and off_stats["prefix_cache_hits_total"] == 0
    assert on_stats["prefill_tokens_computed_total"] < off_stats["prefill_tokens_computed_total"]
    assert off_stats["prefix_cache_queries_total"] > 0  # queries are counted with the cache off too
    if max_kv_tokens == 48:
        assert on_stats["num_preemptions_total"] > 0 and off_stats["num_preemptions_total"] > 0
        return  # pages were evicted under pressure: which hits remain depends on timing of the LRU
    # The second turn found at least the whole-page part of its system prompt under its own adapter.
    for out, (s, _, _) in zip(on[len(ROWS) : 2 * len(ROWS)], SECOND_TURN):
        assert out.cached_tokens >= len(SYSTEM[s]) // BLOCK * BLOCK
    # The n=2 siblings: one computed the prompt, the other waited a step and took its pages.
    assert sorted(o.cached_tokens for o in on[-2:]) == [0, (len(SYSTEM["y"]) + 5 - 1) // BLOCK * BLOCK]
    assert on_stats["kv_cache_usage"] == 0.0 and on_stats["num_running"] == 0


def test_adapters_never_share_pages(llama):
    base, adapters = llama
    engine = _engine(base, adapters, True)
    prompt = SYSTEM["x"] + [40, 41]
    first = {lora: _generate(engine, [("x", [40, 41], lora)])[0] for lora in ("a", "b", None)}
    assert [o.cached_tokens for o in first.values()] == [0, 0, 0]  # same tokens, three different KV states
    again = {lora: _generate(engine, [("x", [40, 41], lora)])[0] for lora in ("a", "b", None)}
    for lora, out in again.items():
        # return_logprob asks the last prompt token's logprob too (logprob_start_len=-1): the position
        # before it runs, so the cache supplies at most len(prompt) - 2 tokens
        assert out.cached_tokens == (len(prompt) - 2) // BLOCK * BLOCK, lora
        assert out.output_ids == first[lora].output_ids
    assert len({tuple(o.output_ids) for o in first.values()}) == 3  # the adapters really differ


def test_adapter_reloaded_under_the_same_name_reuses_nothing(llama):
    base, adapters = llama
    engine = _engine(base, adapters, True)
    as_a = _generate(engine, [("x", [40, 41], "a")])[0]
    as_b = _generate(engine, [("x", [40, 41], "b")])[0]
    pages = engine.stats()["prefix_cache_pages"]
    engine.unload_lora("a")
    dropped = pages - engine.stats()["prefix_cache_pages"]
    assert dropped == (len(SYSTEM["x"]) + 2 + SAMPLING["max_new_tokens"] - 1) // BLOCK  # a's full pages only
    engine.load_lora("a", str(adapters["b"]))  # the name "a" now holds b's weights
    reloaded = _generate(engine, [("x", [40, 41], "a")])[0]
    assert reloaded.cached_tokens == 0
    assert reloaded.output_ids == as_b.output_ids != as_a.output_ids


def test_flush_cache_only_when_idle(llama):
    base, adapters = llama
    engine = _engine(base, adapters, True)
    _generate(engine, ROWS[:3])
    assert engine.stats()["prefix_cache_pages"] > 0
    rid = engine.add_request(input_ids=SYSTEM["x"], sampling_params=SAMPLING)
    assert engine.flush_cache() is False  # a request waits: refused
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.flush_cache() is True
    stats = engine.stats()
    assert stats["prefix_cache_pages"] == 0 and stats["kv_cache_usage"] == 0.0
    assert engine.kv_cache.allocator.num_free == engine.kv_cache.allocator.num_blocks
    assert _generate(engine, ROWS[:1])[0].cached_tokens == 0


def test_disable_radix_and_vllm_spelling_on_the_command_line():
    import argparse

    from mmlora.config import ENGINE_SECTIONS, add_cli_args, engine_config_from_cli

    parser = argparse.ArgumentParser()
    add_cli_args(parser, *ENGINE_SECTIONS)

    def disabled(*argv: str) -> bool:
        return engine_config_from_cli(parser.parse_args(list(argv))).cache.disable_radix

    assert disabled() is False  # on by default
    assert disabled("--disable-radix") is True
    assert disabled("--no-enable-prefix-caching") is True
    assert disabled("--enable-prefix-caching") is False
    assert disabled("--disable-radix", "--enable-prefix-caching") is False  # the last one wins
