"""Prompt logprobs (SGLang's input_token_logprobs, OpenAI's echo with logprobs, vLLM's prompt_logprobs)
against HF + PEFT, over chunked prefill, several adapters in one batch and base-only rows."""

from __future__ import annotations

import math

import pytest
import requests
from hf_oracle import hf_prompt_logprobs, tokenize
from server_fixtures import tiny_engine

import mmlora.engine.prompt_logprobs as prompt_logprobs

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Rome is",
    "Hello world! How are you today? I am fine, thank you. Multi-LoRA serving",
]


def test_engine_prompt_logprobs_match_hf_peft_across_chunks_and_adapters(tiny, monkeypatch):
    # Small prefill chunks and logit chunks: a prompt spans several forwards and several logit chunks.
    monkeypatch.setattr(prompt_logprobs, "CHUNK_ROWS", 3)
    engine = tiny_engine(tiny, max_num_batched_tokens=16)
    rows_seen: list[int] = []
    compute_logits = engine.model.compute_logits

    def recording(hidden):
        rows_seen.append(hidden.shape[0])
        return compute_logits(hidden)

    monkeypatch.setattr(engine.model, "compute_logits", recording)
    loras = [None, "a0", "a1"]
    outs = engine.generate(
        TEXTS,
        lora_paths=loras,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        top_logprobs_num=2,
        logprob_start_len=0,
    )
    assert max(rows_seen) <= 3  # logits exist for at most CHUNK_ROWS positions at a time
    for text, lora, out in zip(TEXTS, loras, outs):
        ids = tokenize(tiny.folder, text)
        expected = hf_prompt_logprobs(tiny.folder, tiny.adapters[lora] if lora else None, ids)
        assert out.output_ids == [] and out.finish_reason == "length"
        assert out.input_ids == ids
        assert out.input_logprobs[0] is None and len(out.input_logprobs) == len(ids)
        assert out.input_logprobs[1:] == pytest.approx(expected, abs=1e-3)
        assert out.input_top_logprobs[0] == []
        for lp, row in zip(out.input_logprobs[1:], out.input_top_logprobs[1:]):
            assert len(row) == 2 and row[0][1] >= row[1][1] and lp <= row[0][1] + 1e-6


def test_engine_start_len_and_bad_start(tiny):
    engine = tiny_engine(tiny)
    ids = tokenize(tiny.folder, TEXTS[0])
    (out,) = engine.generate(
        TEXTS[0], sampling_params={"max_new_tokens": 2}, return_logprob=True, logprob_start_len=3
    )
    expected = hf_prompt_logprobs(tiny.folder, None, ids)
    assert out.input_logprobs == pytest.approx(expected[2:], abs=1e-3)
    assert len(out.output_ids) == 2
    (last,) = engine.generate(TEXTS[0], sampling_params={"max_new_tokens": 1}, return_logprob=True)
    assert last.input_logprobs == pytest.approx(expected[-1:], abs=1e-3)  # -1: the last prompt token
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.generate(TEXTS[0], return_logprob=True, logprob_start_len=len(ids))


def test_generate_input_token_logprobs(server, tiny):
    body = {
        "text": TEXTS[:2],
        "lora_path": ["a2", None],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "top_logprobs_num": 1,
        "logprob_start_len": 2,
    }
    res = requests.post(f"{server.url}/generate", json=body, timeout=60)
    assert res.status_code == 200, res.text
    for text, lora, item in zip(TEXTS, ["a2", None], res.json()):
        ids = tokenize(tiny.folder, text)
        expected = hf_prompt_logprobs(tiny.folder, tiny.adapters[lora] if lora else None, ids)[1:]
        meta = item["meta_info"]
        assert [e[1] for e in meta["input_token_logprobs"]] == ids[2:]
        assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx(expected, abs=1e-3)
        assert all(isinstance(e[2], str) for e in meta["input_token_logprobs"])
        assert len(meta["input_top_logprobs"]) == len(ids) - 2
        assert meta["output_token_logprobs"] == [] and item["output_ids"] == []


def test_openai_echo_logprobs_as_lm_eval_sends_them(server, tiny):
    ids = tokenize(tiny.folder, TEXTS[1])
    expected = hf_prompt_logprobs(tiny.folder, tiny.adapters["a3"], ids)
    for max_tokens in (0, 1):
        body = {"model": "a3", "prompt": [ids], "max_tokens": max_tokens, "temperature": 0}
        res = requests.post(
            f"{server.url}/v1/completions", json={**body, "echo": True, "logprobs": 1}, timeout=60
        )
        assert res.status_code == 200, res.text
        lp = res.json()["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-3)
        for tok_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert tok_lp in top.values() and 1 <= len(top) <= 2
            assert max(top.values()) >= tok_lp


def test_openai_logprobs_zero_gives_one_entry_per_token(server):
    body = {"model": "tiny", "prompt": TEXTS[0], "max_tokens": 4, "temperature": 0, "logprobs": 0}
    res = requests.post(f"{server.url}/v1/completions", json=body, timeout=60)
    lp = res.json()["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == 4
    for tok, tok_lp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top == {tok: tok_lp}


def test_vllm_prompt_logprobs(server, tiny):
    ids = tokenize(tiny.folder, TEXTS[0])
    expected = hf_prompt_logprobs(tiny.folder, None, ids)
    body = {"model": "tiny", "prompt": TEXTS[0], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    res = requests.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert res.status_code == 200, res.text
    choice = res.json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert choice["logprobs"] is None and plp[0] is None and len(plp) == len(ids)
    for t, (tid, entry) in enumerate(zip(ids[1:], plp[1:])):
        assert entry[str(tid)]["logprob"] == pytest.approx(expected[t], abs=1e-3)
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert ranks[:2] == [1, 2] and all(not math.isnan(v["logprob"]) for v in entry.values())
    bad = requests.post(f"{server.url}/v1/completions", json={**body, "prompt_logprobs": 99}, timeout=60)
    assert bad.status_code == 400 and "prompt_logprobs" in bad.text


def test_a_warm_prefix_cache_skips_no_asked_prompt_logprob(tiny):
    """The prefix cache supplies only positions whose logprobs are not asked (SGLang caps the match at
    logprob_start_len); the logprobs still equal HF + PEFT, and later starts do use the cache."""
    engine = tiny_engine(tiny, block_size=4)
    text = TEXTS[2]
    ids = tokenize(tiny.folder, text)
    expected = hf_prompt_logprobs(tiny.folder, tiny.adapters["a0"], ids)  # tokens 1 .. n-1
    engine.generate(text, lora_paths="a0", sampling_params={"max_new_tokens": 1})  # fills the cache
    cached = {}
    for start in (0, 9, len(ids) - 1):
        (out,) = engine.generate(
            text,
            lora_paths="a0",
            sampling_params={"max_new_tokens": 1},
            return_logprob=True,
            logprob_start_len=start,
        )
        got = out.input_logprobs
        assert len(got) == len(ids) - start
        if start == 0:
            assert got[0] is None
            got = got[1:]
        assert got == pytest.approx(expected[max(start, 1) - 1 :], abs=1e-3)
        cached[start] = out.cached_tokens
    assert cached[0] == 0 and 0 < cached[9] <= 8 and cached[len(ids) - 1] > cached[9]
