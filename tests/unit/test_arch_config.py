"""ArchConfig.from_hf: each family's HF config read once into typed fields, bad configs refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

from mmlora.models.arch_config import ArchConfig
from mmlora.models.presets import preset_config

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, vocab_size=100)


def test_llama3_rope_and_gqa_defaults():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}  # fmt: skip
    arch = ArchConfig.from_hf(LlamaConfig(**SMALL, rope_scaling=rope, rope_theta=500000.0))
    assert (arch.rope.rope_type, arch.rope.theta, arch.rope.factor) == ("llama3", 500000.0, 8.0)
    assert arch.rope.original_max_position_embeddings == 64 and arch.rope.mrope_section is None
    assert arch.num_key_value_heads == 4 and arch.head_dim == 16 and arch.attention_scale == 16**-0.5
    assert arch.sliding_windows == (None,) * 4 and not arch.qkv_bias and not arch.tie_word_embeddings


def test_windows_follow_each_familys_pattern():
    assert ArchConfig.from_hf(MistralConfig(**SMALL, sliding_window=7)).sliding_windows == (7,) * 4
    qwen = ArchConfig.from_hf(Qwen2Config(**SMALL, use_sliding_window=False, sliding_window=32))
    assert qwen.sliding_windows == (None,) * 4 and qwen.qkv_bias and not qwen.o_proj_bias
    gemma = ArchConfig.from_hf(
        Gemma2Config(**SMALL, head_dim=32, sliding_window=5, query_pre_attn_scalar=24,
                     attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    )  # fmt: skip
    assert gemma.sliding_windows == (5, None, 5, None) and gemma.tie_word_embeddings
    assert gemma.attention_scale == 24**-0.5 and gemma.head_dim == 32
    assert (gemma.attn_logit_softcap, gemma.final_logit_softcap) == (50.0, 30.0)
    assert gemma.hidden_act == "gelu_pytorch_tanh"


def test_qwen2_vl_text_and_vision_fields():
    arch = ArchConfig.from_hf(preset_config("qwen2-vl-7b"))
    assert arch.rope.rope_type == "default" and arch.rope.mrope_section == (16, 24, 24)
    assert arch.vocab_size == 152064 and arch.qkv_bias and arch.sliding_windows == (None,) * 28
    assert arch.vision is not None and arch.vision.out_hidden_size == arch.hidden_size
    assert (arch.vision.image_token_id, arch.vision.spatial_merge_size) == (151655, 2)


def test_bad_configs_are_refused_by_name():
    # Plain namespaces: transformers' own config classes already refuse some of these.
    def cfg(**kw):
        return SimpleNamespace(**SMALL, model_type="llama", **kw)

    with pytest.raises(ValueError, match="layer_types: 3 entries for 4 layers"):
        ArchConfig.from_hf(cfg(sliding_window=7, layer_types=["full_attention"] * 3))
    with pytest.raises(ValueError, match=r"unsupported layer type\(s\) \['chunked_attention'\]"):
        ArchConfig.from_hf(cfg(layer_types=["chunked_attention"] * 4))
    with pytest.raises(ValueError, match="needs low_freq_factor"):
        ArchConfig.from_hf(cfg(rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        ArchConfig.from_hf(cfg(rope_scaling={"rope_type": "yarn", "factor": 2.0}))
