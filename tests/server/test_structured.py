"""Structured output (xgrammar): JSON schema, regex and EBNF per request, in batches that mix constrained
and free rows on different adapters; the free rows stay equal to HF + PEFT. Also SGLang's stop_regex and
no_stop_trim, and the 400s that name a bad constraint."""

from __future__ import annotations

import json
import re
import threading

import pytest
import requests
from hf_oracle import hf_greedy, tokenize
from server_fixtures import tiny_engine

import mmlora.engine.grammar as grammar

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "ok", "n"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{1,3}!"
EBNF = 'root ::= "ab" ("c" | "d")+ "."'
EBNF_AS_REGEX = r"ab[cd]+\."
FREE = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def check_schema(text: str) -> None:
    """An independent check of SCHEMA (no validator library needed for this small one)."""
    value = json.loads(text)
    assert set(value) == {"color", "ok", "n"}, text
    assert value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
    assert isinstance(value["n"], int) and not isinstance(value["n"], bool) and 0 <= value["n"] <= 99


def test_mixed_batch_constrained_and_free_rows_on_different_adapters(tiny):
    engine = tiny_engine(tiny)
    rows = [
        ("a0", {"max_new_tokens": 256, "temperature": 0, "json_schema": json.dumps(SCHEMA)}),
        ("a1", FREE),
        (None, {"max_new_tokens": 64, "temperature": 0.9, "seed": 3, "regex": REGEX}),
        ("a2", {"max_new_tokens": 64, "temperature": 0, "ebnf": EBNF}),
        (None, FREE),
        ("a3", {"max_new_tokens": 256, "temperature": 1.0, "seed": 7, "json_schema": SCHEMA}),
    ]
    prompt = "The quick brown fox"
    outs = engine.generate([prompt] * len(rows), [r[0] for r in rows], sampling_params=[r[1] for r in rows])
    check_schema(outs[0].text)
    check_schema(outs[5].text)
    assert re.fullmatch(REGEX, outs[2].text), outs[2].text
    assert re.fullmatch(EBNF_AS_REGEX, outs[3].text), outs[3].text
    for i in (0, 2, 3, 5):
        assert outs[i].finish_reason == "stop"
    ids = tokenize(tiny.folder, prompt)
    for i in (1, 4):  # free rows: untouched by their neighbours' masks
        adapter = tiny.adapters[rows[i][0]] if rows[i][0] else None
        assert outs[i].output_ids == hf_greedy(tiny.folder, adapter, ids, FREE["max_new_tokens"])


def test_grammars_compile_off_the_engine_thread_and_are_cached(server, monkeypatch):
    threads: list[str] = []
    real = grammar._compile

    def recording(compiler, kind, spec):
        threads.append(threading.current_thread().name)
        return real(compiler, kind, spec)

    monkeypatch.setattr(grammar, "_compile", recording)
    body = {
        "text": "Hello",
        "sampling_params": {"max_new_tokens": 40, "temperature": 0, "regex": "[ab]{2,4}"},
    }
    for _ in range(2):
        res = requests.post(f"{server.url}/generate", json=body, timeout=60)
        assert res.status_code == 200, res.text
        assert re.fullmatch("[ab]{2,4}", res.json()["text"])
    assert len(threads) == 1  # the second request found it cached
    assert threads[0] != server.bg._thread.name


def test_generate_accepts_the_fields_sglang_sends_as_null(server):
    sampling = {
        "max_new_tokens": 64,
        "temperature": 0,
        "json_schema": None,
        "regex": None,
        "ebnf": None,
        "stop_regex": None,
        "spaces_between_special_tokens": True,
        "no_stop_trim": False,
        "skip_special_tokens": True,
    }
    res = requests.post(
        f"{server.url}/generate", json={"text": "Hi", "sampling_params": sampling}, timeout=60
    )
    assert res.status_code == 200, res.text
    res = requests.post(
        f"{server.url}/generate",
        json={"text": "Hi", "lora_path": "a4", "sampling_params": {**sampling, "ebnf": EBNF}},
        timeout=60,
    )
    assert res.status_code == 200 and re.fullmatch(EBNF_AS_REGEX, res.json()["text"])


def test_openai_response_format_and_vllm_guided_extras(server):
    chat = {
        "model": "a1",
        "messages": [{"role": "user", "content": "Give me a color."}],
        "max_tokens": 256,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
    }
    res = requests.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert res.status_code == 200, res.text
    check_schema(res.json()["choices"][0]["message"]["content"])
    completion = {"model": "tiny", "prompt": "Answer:", "max_tokens": 64, "temperature": 0}
    res = requests.post(
        f"{server.url}/v1/completions", json={**completion, "guided_regex": REGEX}, timeout=60
    )
    assert re.fullmatch(REGEX, res.json()["choices"][0]["text"])
    res = requests.post(
        f"{server.url}/v1/completions",
        json={**completion, "max_tokens": 256, "guided_json": SCHEMA},
        timeout=60,
    )
    check_schema(res.json()["choices"][0]["text"])
    obj = {**chat, "model": "tiny", "response_format": {"type": "json_object"}, "max_tokens": 48}
    res = requests.post(f"{server.url}/v1/chat/completions", json={**obj, "temperature": 0.0}, timeout=60)
    choice = res.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # a random model may run out of tokens inside an object; what it wrote is still JSON-shaped
        assert choice["message"]["content"].startswith("{")


@pytest.mark.parametrize(
    ("url", "body", "names"),
    [
        ("/generate", {"sampling_params": {"json_schema": "{not json"}}, "json_schema"),
        ("/generate", {"sampling_params": {"json_schema": '{"type": "nonsense"}'}}, "json_schema"),
        ("/generate", {"sampling_params": {"regex": "(unclosed"}}, "regex"),
        ("/generate", {"sampling_params": {"ebnf": "root ::= missing_rule"}}, "ebnf"),
        ("/generate", {"sampling_params": {"regex": "a", "ebnf": EBNF}}, "regex, ebnf"),
        ("/generate", {"sampling_params": {"stop_regex": "(bad"}}, "stop_regex"),
        ("/v1/completions", {"guided_regex": "(unclosed"}, "regex"),
        ("/v1/completions", {"guided_regex": "a", "guided_json": SCHEMA}, "guided_json, guided_regex"),
        ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
        ("/v1/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_it(server, url, body, names):
    base = {"text": "Hi"} if url == "/generate" else {"model": "tiny", "prompt": "Hi", "max_tokens": 4}
    res = requests.post(server.url + url, json={**base, **body}, timeout=60)
    assert res.status_code == 400, res.text
    assert names in res.json()["error"]["message"]


def test_stop_regex_and_no_stop_trim(tiny):
    engine = tiny_engine(tiny)
    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    (free,) = engine.generate("Hello world", sampling_params=greedy)
    text = free.text
    piece = text[6:9]
    cut = text.find(piece)
    assert cut >= 0 and piece
    (trimmed,) = engine.generate("Hello world", sampling_params={**greedy, "stop_regex": [re.escape(piece)]})
    (kept,) = engine.generate(
        "Hello world", sampling_params={**greedy, "stop_regex": re.escape(piece), "no_stop_trim": True}
    )
    assert trimmed.text == text[:cut] and trimmed.finish_reason == "stop"
    assert kept.text == text[: cut + len(piece)] and kept.matched_stop == re.escape(piece)
    (kept_str,) = engine.generate(
        "Hello world", sampling_params={**greedy, "stop": [piece], "no_stop_trim": True}
    )
    assert kept_str.text == text[: cut + len(piece)] and kept_str.matched_stop == piece


class BrokenMatcher:
    """A grammar matcher that fails in one call (``mask``: filling its bitmask raises; ``accept``: it
    refuses the token its own mask allowed): a fault of that one request's grammar."""

    def __init__(self, real, broken: str):
        self.real, self.broken = real, broken

    def fill_next_token_bitmask(self, bitmask, index):
        if self.broken == "mask":
            raise RuntimeError("injected grammar fault")
        return self.real.fill_next_token_bitmask(bitmask, index)

    def accept_token(self, token):
        return self.broken != "accept" and self.real.accept_token(token)

    def is_terminated(self):
        return self.real.is_terminated()


@pytest.mark.parametrize("broken", ["mask", "accept"])
def test_a_failing_grammar_fails_only_its_request(tiny, broken):
    """The engine step's fault isolation covers grammars: the broken request ends with an internal
    error; constrained and free neighbours (other adapters) produce what they produce without it."""
    engine = tiny_engine(tiny)
    rows = [
        ("a0", {"max_new_tokens": 64, "temperature": 0, "regex": REGEX}),
        ("a1", FREE),
        (None, {"max_new_tokens": 64, "temperature": 0, "ebnf": EBNF}),
    ]

    def run(with_broken: bool) -> dict:
        for i, (lora, sp) in enumerate(rows):
            engine.add_request("The quick brown fox", sampling_params=sp, lora=lora, request_id=f"n{i}")
        if with_broken:
            bad = {"max_new_tokens": 16, "temperature": 0, "regex": "[ab]{2,8}"}
            engine.add_request("Hello", sampling_params=bad, lora="a2", request_id="bad")
            state = engine._requests["bad"].grammar
            state.matcher = BrokenMatcher(state.matcher, broken)
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return done

    alone, done = run(False), run(True)
    assert done["bad"].finish_reason == "abort"
    why = "injected grammar fault" if broken == "mask" else "grammar rejected token"
    assert done["bad"].error.startswith("internal error: RuntimeError") and why in done["bad"].error
    for i in range(len(rows)):
        assert done[f"n{i}"].error is None
        assert done[f"n{i}"].output_ids == alone[f"n{i}"].output_ids, f"neighbour n{i} changed"
    assert re.fullmatch(REGEX, done["n0"].text) and re.fullmatch(EBNF_AS_REGEX, done["n2"].text)
    assert engine.kv_cache.allocator.num_free == engine.kv_cache.allocator.num_blocks
