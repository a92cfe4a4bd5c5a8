"""POST /generate (SGLang's native API) against HF + PEFT greedy, plus its shapes, streaming and logprobs."""

from __future__ import annotations

import json
import math

import requests
from hf_oracle import hf_greedy, tokenize

PROMPTS = [
    "Hello world",
    "The quick brown fox",
    "Paris is the capital of",
    "Multi-LoRA serving",
    "How are you",
]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def test_batch_with_a_different_adapter_per_prompt_equals_hf_peft(server, tiny):
    loras = ["a0", None, "a1", "a2", str(tiny.adapters["a4"])]  # names, base, and a registered path
    r = requests.post(
        server.url + "/generate",
        json={"text": PROMPTS, "sampling_params": GREEDY, "lora_path": loras},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body, list) and len(body) == len(PROMPTS)
    for prompt, lora, item in zip(PROMPTS, loras, body):
        adapter = None if lora is None else tiny.adapters.get(lora, lora)
        ids = tokenize(tiny.folder, prompt)
        expected = hf_greedy(tiny.folder, adapter, ids, GREEDY["max_new_tokens"])
        assert item["output_ids"] == expected, (prompt, lora)
        meta = item["meta_info"]
        assert meta["prompt_tokens"] == len(ids)
        assert meta["completion_tokens"] == GREEDY["max_new_tokens"]
        assert meta["finish_reason"] == {"type": "length", "length": GREEDY["max_new_tokens"]}
        assert meta["lora_path"] == lora
        assert meta["e2e_latency"] > 0 and isinstance(meta["id"], str)
    # adapters change the answer (else the comparison above would prove little)
    base_ids = hf_greedy(tiny.folder, None, tokenize(tiny.folder, PROMPTS[0]), 12)
    assert body[0]["output_ids"] != base_ids


def test_single_text_answers_one_object_and_input_ids_work(server, tiny):
    ids = tokenize(tiny.folder, "Hello world")
    r = requests.post(
        server.url + "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {**GREEDY, "max_new_tokens": 5},
            "lora_path": "a3",
            "rid": "my-1",
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body, dict)
    assert body["meta_info"]["id"] == "my-1"
    assert body["output_ids"] == hf_greedy(tiny.folder, tiny.adapters["a3"], ids, 5)
    assert isinstance(body["text"], str)


def test_stream_sends_cumulative_events_then_done(server, tiny):
    r = requests.post(
        server.url + "/generate",
        json={"text": ["Hello world", "How are you"], "sampling_params": {**GREEDY, "max_new_tokens": 6},
              "lora_path": ["a1", None], "stream": True},
        stream=True,
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    last = {}
    for ev in events:
        assert "index" in ev and "text" in ev and "meta_info" in ev
        prev = last.get(ev["index"])
        if prev is not None:  # cumulative: each event extends the previous one
            assert ev["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        last[ev["index"]] = ev
    assert set(last) == {0, 1}
    for i, (prompt, lora) in enumerate([("Hello world", tiny.adapters["a1"]), ("How are you", None)]):
        assert last[i]["meta_info"]["finish_reason"]["type"] == "length"
        assert last[i]["output_ids"] == hf_greedy(tiny.folder, lora, tokenize(tiny.folder, prompt), 6)


def test_logprobs_and_n(server, tiny):
    r = requests.post(
        server.url + "/generate",
        json={"text": "Hello world", "sampling_params": {**GREEDY, "max_new_tokens": 4},
              "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    toks = meta["output_token_logprobs"]
    assert len(toks) == 4 and all(len(t) == 3 and t[0] <= 0 and isinstance(t[2], str) for t in toks)
    tops = meta["output_top_logprobs"]
    assert len(tops) == 4 and all(len(row) == 3 for row in tops)
    for (lp, tid, _), row in zip(toks, tops):  # greedy: the chosen token is the most likely one
        assert row[0][1] == tid and math.isclose(row[0][0], lp, abs_tol=1e-5)

    r = requests.post(
        server.url + "/generate",
        json={
            "text": "Hello",
            "sampling_params": {"max_new_tokens": 4, "n": 3, "temperature": 1.0, "seed": 7},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert isinstance(r.json(), list) and len(r.json()) == 3


def test_seeded_sampling_is_reproducible(server):
    body = {"text": "The quick", "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "seed": 123}}
    a = requests.post(server.url + "/generate", json=body, timeout=60).json()
    b = requests.post(server.url + "/generate", json=body, timeout=60).json()
    assert a["output_ids"] == b["output_ids"]
