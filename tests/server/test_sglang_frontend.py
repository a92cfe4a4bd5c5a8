"""SGLang's own frontend language (``sglang`` 0.5.23, installed without its GPU dependencies) runs its
programs against the server unchanged: sgl.gen, sgl.select, sgl.gen with a regex, fork/join, and the
per-call lora_path of ``sglang.Runtime.generate``. Results are checked against HF + PEFT."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hf_oracle import hf_greedy, hf_prompt_logprobs, tokenize
from transformers import AutoTokenizer

sgl = pytest.importorskip("sglang")


@pytest.fixture(scope="module")
def backend(server):
    endpoint = sgl.RuntimeEndpoint(server.url)  # asks /get_model_info first, as a user's script does
    sgl.set_default_backend(endpoint)
    return endpoint


def _decode(tiny, ids: list[int]) -> str:
    return AutoTokenizer.from_pretrained(tiny.folder).decode(ids, skip_special_tokens=True)


def test_server_info_through_the_frontend(backend, tiny):
    info = sgl.get_server_info()  # RuntimeEndpoint reads /server_info
    assert info["model_path"] == str(tiny.folder) and info["served_model_name"] == "tiny"
    assert info["max_loras_per_batch"] == 4 and "api_key" not in info
    assert backend.get_model_name() == str(tiny.folder)


def test_gen_equals_hf_greedy(backend, tiny):
    @sgl.function
    def answer(s, question):
        s += "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=8, temperature=0, ignore_eos=True)

    state = answer.run(question="Paris is the capital of")
    assert state.get_meta_info("answer")["completion_tokens"] == 8
    ids = tokenize(tiny.folder, "Q: Paris is the capital of\nA:")
    assert state["answer"] == _decode(tiny, hf_greedy(tiny.folder, None, ids, 8))


def test_select_picks_by_hf_peft_logprobs(backend, tiny):
    choices = ["red", "blue", "the lazy dog"]

    @sgl.function
    def pick(s):
        s += "The quick brown fox jumps over"
        s += sgl.select("choice", choices=choices)

    state = pick.run()
    meta = state.get_meta_info("choice")
    means = []
    for choice, entries in zip(choices, meta["input_token_logprobs"]):
        ids = tokenize(tiny.folder, "The quick brown fox jumps over" + choice)
        expected = hf_prompt_logprobs(tiny.folder, None, ids)[-len(entries) :]
        assert [e[1] for e in entries] == ids[-len(entries) :]
        assert [e[0] for e in entries] == pytest.approx(expected, abs=1e-3)
        means.append(float(np.mean(expected)))
    assert state["choice"] == choices[int(np.argmax(means))]


def test_gen_with_regex_and_dtype(backend):
    @sgl.function
    def constrained(s):
        s += "Answer yes or no, then a number: "
        s += sgl.gen("yn", max_tokens=32, regex=r"(yes|no), [0-9]{1,3}", temperature=0)
        s += "\nJSON: "
        s += sgl.gen("obj", max_tokens=128, json_schema=json.dumps(_SCHEMA), temperature=0)
        s += "\nCount: "
        s += sgl.gen_int("count", max_tokens=8)

    state = constrained.run()
    assert re.fullmatch(r"(yes|no), [0-9]{1,3}", state["yn"]), state["yn"]
    assert json.loads(state["obj"])["ok"] in (True, False)
    int(state["count"])


_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def test_fork_join_equals_hf_greedy(backend, tiny):
    tails = [" Paris", " Rome"]

    @sgl.function
    def branches(s):
        s += "Hello world!"
        forks = s.fork(len(tails))
        for f, tail in zip(forks, tails):
            f += tail
            f += sgl.gen("more", max_tokens=6, temperature=0, ignore_eos=True)
        forks.join()
        s += " | ".join(f["more"] for f in forks)

    state = branches.run()
    texts = state.text().removeprefix("Hello world!").split(" | ")
    for tail, text in zip(tails, texts):
        ids = tokenize(tiny.folder, "Hello world!" + tail)
        assert text == _decode(tiny, hf_greedy(tiny.folder, None, ids, 6))


def test_runtime_generate_with_per_call_lora_path(server, tiny):
    # sglang.Runtime.generate is the frontend's API with a per-call lora_path. Runtime.__init__ would
    # launch SGLang's own server, so the object is pointed at ours instead.
    from sglang.lang.backend.runtime_endpoint import Runtime

    runtime = object.__new__(Runtime)
    runtime.url, runtime.pid = server.url, None  # pid None: nothing of ours to shut down
    prompts = ["The quick brown fox", "Hello world"]
    sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    answer = json.loads(runtime.generate(prompts, sampling, lora_path=["a1", None]))
    for prompt, lora, item in zip(prompts, ["a1", None], answer):
        ids = tokenize(tiny.folder, prompt)
        assert item["output_ids"] == hf_greedy(tiny.folder, tiny.adapters[lora] if lora else None, ids, 6)
        assert item["meta_info"]["lora_path"] == lora
