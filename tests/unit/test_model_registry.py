"""Model registry: supported architectures resolve to their class; anything else is refused with the list."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import mmlora
from mmlora.models.registry import model_class_for, supported_architectures


@pytest.mark.parametrize(
    "arch",
    [
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Gemma2ForCausalLM",
        "Qwen2VLForConditionalGeneration",
    ],
)
def test_supported_architectures_resolve(arch):
    assert arch in supported_architectures()
    cls = model_class_for(SimpleNamespace(architectures=[arch], model_type="x"))
    assert arch in cls.hf_architectures


def test_model_type_fallback_for_configs_without_architectures():
    assert (
        model_class_for(SimpleNamespace(architectures=None, model_type="gemma2")).__name__
        == "Gemma2ForCausalLM"
    )


def test_unsupported_architecture_is_refused_with_the_list():
    with pytest.raises(ValueError) as info:
        model_class_for(SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    for arch in supported_architectures():
        assert arch in message


def test_engine_refuses_unsupported_checkpoint_at_load(tmp_path):
    """A real checkpoint folder of an unsupported architecture: a ValueError, never an AttributeError."""
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_layer": 1,
        "n_embd": 8,
        "n_head": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported model architecture.*supported: .*Gemma2ForCausalLM"):
        mmlora.Engine(model=str(tmp_path), device="cpu")
