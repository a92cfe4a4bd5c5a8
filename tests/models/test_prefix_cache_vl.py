"""Prefix cache on tiny Qwen2-VL: image contents are part of a page's key.

Greedy outputs identical with the cache on and off (the oracle: ``disable_radix=True``, itself checked
against HF + PEFT in test_qwen2_vl_vs_peft.py) over images, text-only rows, two adapters and base rows,
16-token prefill chunks that cut image runs, and a KV cache small enough to preempt. The same text with a
different image reuses the pages before the image and nothing from the image on.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import ALL_SEVEN, make_adapter, make_qwen2_vl_checkpoint

import mmlora

BLOCK = 4
SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
TEXT = f"The quick brown fox jumps over {SLOT} the lazy dog. What is it?"
SAMPLING = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}


def _image(seed: int, size: int = 112):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size, size, 3)) * 255).astype("uint8"))


# (text, image seed or None, adapter)
ROWS = [
    (TEXT, 1, "a"),
    (TEXT, 2, "a"),  # same text, another image
    (TEXT, 1, "b"),  # same text and image, another adapter
    (TEXT, 1, None),
    ("The quick brown fox jumps over the lazy dog.", None, "a"),
    (f"{SLOT} Paris is the capital of", 3, None),
]


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-vl")
    base = make_qwen2_vl_checkpoint(root / "base")
    kw = dict(model_class="Qwen2VLForConditionalGeneration")
    adapters = {
        "a": make_adapter(base, root / "a", 1, r=4, lora_alpha=8, target_modules=ALL_SEVEN, **kw),
        "b": make_adapter(base, root / "b", 2, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], **kw),
    }
    return base, adapters


def _engine(base, adapters, cache: bool, **kw) -> mmlora.Engine:
    return mmlora.Engine(
        model=str(base), lora_paths={n: str(p) for n, p in adapters.items()}, max_loras_per_batch=2,
        max_lora_rank=4, block_size=BLOCK, device="cpu", dtype="float32", disable_radix=not cache, **kw,
    )  # fmt: skip


def _generate(engine, rows):
    return engine.generate(
        [t for t, _, _ in rows], [a for _, _, a in rows],
        [[_image(i)] if i is not None else None for _, i, _ in rows], SAMPLING, return_logprob=True,
    )  # fmt: skip


@pytest.mark.parametrize("max_kv_tokens", [1024, 96], ids=["roomy", "preempting"])
def test_greedy_outputs_identical_with_cache_on_and_off(tiny_vl, max_kv_tokens):
    base, adapters = tiny_vl
    kw = dict(max_kv_tokens=max_kv_tokens, max_num_batched_tokens=16)
    results = {}
    for cache in (True, False):
        engine = _engine(base, adapters, cache, **kw)
        results[cache] = (_generate(engine, ROWS) + _generate(engine, ROWS), engine.stats())
    (on, on_stats), (off, _) = results[True], results[False]
    for i, (a, b) in enumerate(zip(on, off)):
        assert a.error is None and a.output_ids == b.output_ids, f"request {i}"
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4), f"request {i}"
    assert on_stats["prefix_cache_hits_total"] > 0
    if max_kv_tokens == 1024:
        assert all(
            out.cached_tokens > 0 for out in on[len(ROWS) :]
        )  # the second batch hits the first's pages
    else:
        assert on_stats["num_preemptions_total"] > 0
    assert on[0].output_ids != on[1].output_ids  # the image matters


def test_same_text_with_another_image_reuses_nothing_past_the_image(tiny_vl):
    base, adapters = tiny_vl
    engine = _engine(base, adapters, True)
    ids, mm = engine.multimodal.prepare_prompt(engine.tokenizer, TEXT, None, [_image(1)])
    ((start, length),) = mm.spans
    assert start >= 2 * BLOCK and length > 2 * BLOCK  # pages before the image, several pages of image
    first = _generate(engine, [(TEXT, 1, "a")])[0]
    other = _generate(engine, [(TEXT, 2, "a")])[0]
    assert first.cached_tokens == 0
    assert other.cached_tokens == start // BLOCK * BLOCK  # the text before the image, not one token more
    again = _generate(engine, [(TEXT, 1, "a")])[0]
    assert again.cached_tokens == (len(ids) - 1) // BLOCK * BLOCK  # past the image: same pixels
    assert again.output_ids == first.output_ids != other.output_ids
    # The same pixels given again (another PIL object) hash the same: the key is the content.
    _, mm2 = engine.multimodal.prepare_prompt(engine.tokenizer, TEXT, None, [_image(1)])
    assert mm2.image_hashes == mm.image_hashes
