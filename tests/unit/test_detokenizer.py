"""Incremental detokenization: step by step, the text equals a full decode, and stop strings cut it."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tokenizer

from mmlora.engine.detokenizer import ids_decoder, take_delta, update_text
from mmlora.engine.request import Request
from mmlora.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def run(tok, ids, **sampling):
    req = Request("r", [1], SamplingParams(**sampling), None)
    deltas = []
    for i, t in enumerate(ids):
        req.output_ids.append(t)
        if i == len(ids) - 1:
            req.finish_reason = "length"
        update_text(req, ids_decoder(tok))
        if req.finish_reason == "stop":
            req.status = req.status.FINISHED
            deltas.append(take_delta(req))
            break
        if i == len(ids) - 1:
            req.status = req.status.FINISHED
        deltas.append(take_delta(req))
    return req, deltas


@pytest.mark.parametrize("seed", range(8))
def test_incremental_text_equals_full_decode(tok, seed):
    rng = random.Random(seed)
    # Byte-level tokens (ids of single bytes of multi-byte characters) appear in random sequences.
    ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))]
    req, deltas = run(tok, ids)
    assert req.text == tok.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == req.text


def test_multibyte_characters_are_not_split(tok):
    ids = tok("café — naïve ✓", add_special_tokens=False)["input_ids"]
    req, deltas = run(tok, ids)
    assert req.text == "café — naïve ✓"
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_cuts_the_text_and_is_never_streamed(tok):
    ids = tok("Hello world! How are you today?", add_special_tokens=False)["input_ids"]
    req, deltas = run(tok, ids, stop=["How are"])
    assert req.finish_reason == "stop" and req.matched_stop == "How are"
    assert req.text == "Hello world! "
    assert "".join(deltas) == req.text and not any("How" in d for d in deltas)


@pytest.mark.parametrize("cleanup", [False, True])
def test_the_decoder_equals_the_tokenizers_decode(tok, cleanup):
    """ids_decoder calls a fast tokenizer's backend directly when it cleans up no spaces (else its own
    decode): the text must be decode's, with and without special tokens, over random ids including the
    special ones, and with the clean-up switched on (where decode's own path is kept)."""
    tok.clean_up_tokenization_spaces = cleanup
    try:
        decode = ids_decoder(tok)
        rng = random.Random(3)
        specials = tok.all_special_ids
        for _ in range(200):
            ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(12)]
            for skip in (True, False):
                want = tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=True)
                assert decode(ids, skip, True) == want, (ids, skip)
        words = tok("a , b . c ! d", add_special_tokens=False)["input_ids"]
        assert decode(words, True, True) == tok.decode(words, skip_special_tokens=True)
    finally:
        tok.clean_up_tokenization_spaces = False
