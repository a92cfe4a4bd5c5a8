"""Out of KV pages: the scheduler preempts (recompute) instead of crashing, and greedy outputs do not change.

The oracle is the same engine configuration with a KV cache large enough that nothing is preempted.
"""

from __future__ import annotations

import pytest
from tiny_models import llama_with_two_ranks

import mmlora

PROMPTS = [[5, 9, 13, 2, 7], [31, 4, 4, 8, 19, 3, 6], [11, 12, 13], [40, 41, 2, 9, 9, 9]]
LORAS = ["a", None, "b", "a"]
SAMPLING = {"max_new_tokens": 14, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return llama_with_two_ranks(tmp_path_factory.mktemp("preempt"))


def _run(base, adapters, max_kv_tokens: int) -> tuple[list, dict]:
    engine = mmlora.Engine(
        model=str(base),
        lora_paths={n: str(p) for n, p in adapters.items()},
        max_loras_per_batch=2,
        max_lora_rank=4,
        block_size=4,
        max_kv_tokens=max_kv_tokens,
        device="cpu",
        dtype="float32",
    )
    outs = engine.generate(input_ids=PROMPTS, lora_paths=LORAS, sampling_params=SAMPLING, return_logprob=True)
    return outs, engine.stats()


def test_preemption_keeps_greedy_outputs(tiny):
    base, adapters = tiny
    ref, ref_stats = _run(base, adapters, max_kv_tokens=1024)
    assert ref_stats["num_preemptions_total"] == 0
    # 6 pages of 4 tokens: each request alone fits (at most 21 tokens), all four together need 20 pages.
    small, stats = _run(base, adapters, max_kv_tokens=24)
    assert stats["num_preemptions_total"] > 0
    assert stats["kv_tokens_total"] == 24
    for r, s in zip(ref, small):
        assert s.finish_reason == "length" and s.error is None
        assert s.output_ids == r.output_ids
        assert s.logprobs == pytest.approx(r.logprobs, abs=1e-4)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0.0


def test_request_larger_than_the_cache_is_refused(tiny):
    base, adapters = tiny
    engine = mmlora.Engine(model=str(base), block_size=4, max_kv_tokens=8, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="do not fit in the KV cache"):
        engine.add_request(input_ids=list(range(3, 12)), sampling_params=SAMPLING)
    # It fits at first but would outgrow the whole cache: it fails with an error, never a crash.
    out = engine.generate(input_ids=[[3, 4, 5]], sampling_params=SAMPLING)[0]
    assert out.finish_reason == "abort" and "more KV cache" in (out.error or "")
