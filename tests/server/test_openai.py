"""The OpenAI-compatible API through the official ``openai`` SDK: completions, chat, streaming, models."""

from __future__ import annotations

import openai
import pytest
from hf_oracle import hf_greedy, tokenize
from transformers import AutoTokenizer

GREEDY_EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny):
    return AutoTokenizer.from_pretrained(tiny.folder)


def expected_text(tiny, tok, adapter, prompt: str, n: int) -> str:
    ids = hf_greedy(tiny.folder, adapter, tokenize(tiny.folder, prompt), n)
    return tok.decode(ids, skip_special_tokens=True)


def test_models_lists_base_and_adapters(client, tiny):
    models = {m.id: m for m in client.models.list().data}
    assert "tiny" in models and set(tiny.adapters) <= set(models)
    assert models["a0"].parent == "tiny" and models["a0"].root == str(tiny.adapters["a0"])
    assert models["tiny"].parent is None


@pytest.mark.parametrize("model,adapter", [("tiny", None), ("a2", "a2"), ("tiny:a0", "a0")])
def test_completion_selects_the_model_and_equals_hf_peft(client, tiny, tok, model, adapter):
    res = client.completions.create(
        model=model, prompt="The quick brown fox", max_tokens=8, temperature=0, extra_body=GREEDY_EXTRA
    )
    assert res.model == model and res.object == "text_completion"
    choice = res.choices[0]
    lora = None if adapter is None else tiny.adapters[adapter]
    assert choice.text == expected_text(tiny, tok, lora, "The quick brown fox", 8)
    assert choice.finish_reason == "length"
    n_prompt = len(tokenize(tiny.folder, "The quick brown fox"))
    assert res.usage.prompt_tokens == n_prompt and res.usage.completion_tokens == 8
    assert res.usage.total_tokens == n_prompt + 8


def test_completion_batch_n_logprobs_stop(client):
    res = client.completions.create(
        model="a1", prompt=["Hello", "How are you"], max_tokens=5, n=2, temperature=0.8, seed=3, logprobs=2
    )
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    for c in res.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) <= 5
        # OpenAI: "the logprob of the sampled token is always returned, so up to logprobs+1 elements"
        for token, lp, top in zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs):
            assert 1 <= len(top) <= 3 and top[token] == lp  # fewer when texts coincide (byte pieces)
    assert res.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in res.choices)
    # a stop string ends the text before it
    full = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=10, temperature=0, extra_body=GREEDY_EXTRA
    )
    text = full.choices[0].text
    cut = text[3:5] if len(text.strip()) >= 5 and text[3:5].strip() else None
    if cut:
        stopped = client.completions.create(
            model="tiny", prompt="Hello", max_tokens=10, temperature=0, stop=[cut]
        )
        assert stopped.choices[0].finish_reason == "stop"
        assert cut not in stopped.choices[0].text and text.startswith(stopped.choices[0].text)


def test_completion_stream_with_usage(client, tiny, tok):
    stream = client.completions.create(
        model="a3", prompt="Paris is", max_tokens=7, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=GREEDY_EXTRA,
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(tiny, tok, tiny.adapters["a3"], "Paris is", 7)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_uses_the_chat_template(client, tiny, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    res = client.chat.completions.create(
        model="tiny:a4", messages=messages, max_completion_tokens=6, temperature=0, extra_body=GREEDY_EXTRA
    )
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|assistant|>")
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == expected_text(tiny, tok, tiny.adapters["a4"], prompt, 6)
    assert res.usage.prompt_tokens == len(tokenize(tiny.folder, prompt))


def test_chat_stream_logprobs_and_text_parts(client, tiny, tok):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "How are"}, {"type": "text", "text": "you"}]}
    ]
    stream = client.chat.completions.create(
        model="a0", messages=messages, max_tokens=5, temperature=0, stream=True, logprobs=True, top_logprobs=2,
        stream_options={"include_usage": True}, extra_body=GREEDY_EXTRA,
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    joined = [{"role": "user", "content": "How are\nyou"}]
    prompt = tok.apply_chat_template(joined, add_generation_prompt=True, tokenize=False)
    assert content == expected_text(tiny, tok, tiny.adapters["a0"], prompt, 5)
    lps = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert len(lps) == 5 and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)
    assert chunks[-1].usage.completion_tokens == 5


def test_adapter_by_path_through_lora_path_extra(client, tiny, tok):
    res = client.completions.create(
        model="tiny", prompt="Hello world", max_tokens=4, temperature=0,
        extra_body={**GREEDY_EXTRA, "lora_path": str(tiny.adapters["a2"])},
    )  # fmt: skip
    assert res.choices[0].text == expected_text(tiny, tok, tiny.adapters["a2"], "Hello world", 4)


def test_unknown_model_is_404_with_openai_envelope(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.status_code == 404
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], temperature=-1
        )


def test_echo_and_model_given_as_an_adapter_path(client, tiny, tok):
    path = str(tiny.adapters["a1"])
    res = client.completions.create(
        model=path, prompt="Hello world", max_tokens=4, temperature=0, echo=True, extra_body=GREEDY_EXTRA
    )
    text = res.choices[0].text
    assert text == "Hello world" + expected_text(tiny, tok, tiny.adapters["a1"], "Hello world", 4)
    res = client.completions.create(model=f"tiny:{path}", prompt="Hello world", max_tokens=4, temperature=0,
                                    extra_body=GREEDY_EXTRA)  # fmt: skip
    assert "Hello world" + res.choices[0].text == text
