"""What load_adapter refuses: every refusal is an AdapterError naming the adapter's path and the problem,
for hand-spoiled files and for real PEFT adapters with features mmlora does not serve."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from adapter_oracle import ALL_SEVEN, llama_config, lora_spec, make_adapter, qwen2_config
from safetensors.torch import load_file, save_file

from mmlora.lora.adapter import AdapterError, load_adapter
from mmlora.lora.spec import LoRAModelSpec

SPEC = lora_spec(llama_config())
QA = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
QB = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def base_adapter(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "adapter"
    make_adapter(path, llama_config(), r=4, lora_alpha=8, target_modules=ALL_SEVEN)
    return path


@pytest.fixture
def adapter(base_adapter, tmp_path):
    """A fresh copy of a valid all-seven-projections rank-4 adapter, to spoil."""
    dst = tmp_path / "adapter"
    shutil.copytree(base_adapter, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    file = path / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


def edit_tensors(path: Path, fn) -> None:
    file = path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    fn(tensors)
    save_file(tensors, str(file))


def refused(path: Path, phrase: str, spec: LoRAModelSpec = SPEC, max_lora_rank: int = 8, **kwargs) -> str:
    with pytest.raises(AdapterError) as info:
        load_adapter(path, spec, max_lora_rank=max_lora_rank, **kwargs)
    message = str(info.value)
    assert phrase in message
    assert str(path) in message
    return message


def test_overlapping_patterns_reordered_by_save_are_refused(tmp_path):
    """PEFT saves the config with sorted keys, so overlapping patterns can match differently on reload
    (PeftModel.from_pretrained then fails with a size mismatch); the loader refuses with a clear message."""
    make_adapter(
        tmp_path, llama_config(), r=4, target_modules=["q_proj"],
        rank_pattern={"q_proj": 2, r"layers\.0\.self_attn\.q_proj": 6},
    )  # fmt: skip
    refused(
        tmp_path, "'model.layers.0.self_attn.q_proj' has rank 2 in its tensors but the config implies r=6"
    )


def test_valid_copy_loads(adapter):
    assert load_adapter(adapter, SPEC, max_lora_rank=8).rank == 4


def test_missing_folder(tmp_path):
    refused(tmp_path / "nope", "no such adapter folder")


def test_path_is_a_file(adapter):
    refused(adapter / "adapter_config.json", "is not a folder")


def test_missing_config(adapter):
    (adapter / "adapter_config.json").unlink()
    refused(adapter, "missing adapter_config.json")


def test_missing_weights(adapter):
    (adapter / "adapter_model.safetensors").unlink()
    refused(adapter, "missing weights file")


@pytest.mark.parametrize("text", ['{"r": 4,', "[1, 2]", "\xff\xfe"])
def test_corrupt_config(adapter, text):
    (adapter / "adapter_config.json").write_bytes(text.encode("latin-1"))
    refused(adapter, "corrupt adapter_config.json")


@pytest.mark.parametrize("how", ["garbage", "truncated"])
def test_corrupt_safetensors(adapter, how):
    file = adapter / "adapter_model.safetensors"
    data = file.read_bytes()
    file.write_bytes(b"\x00garbage" * 10 if how == "garbage" else data[: len(data) // 2])
    refused(adapter, "corrupt adapter_model.safetensors")


def test_pickled_refused_by_default(tmp_path):
    make_adapter(tmp_path, llama_config(), safe=False, r=4, target_modules=["q_proj"])
    message = refused(tmp_path, "pickled adapters")
    assert "allow_pickled_adapters=True" in message and "--allow-pickled-adapters" in message
    assert "safetensors" in message


class _Evil:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path(__import__('os').environ['EVIL_MARK']).touch()",))


def test_pickled_code_never_runs(adapter, tmp_path, monkeypatch):
    mark = tmp_path / "pwned"
    monkeypatch.setenv("EVIL_MARK", str(mark))
    (adapter / "adapter_model.safetensors").unlink()
    torch.save({QA: _Evil()}, adapter / "adapter_model.bin")
    refused(adapter, "corrupt adapter_model.bin", allow_pickled=True)
    assert not mark.exists()


@pytest.mark.parametrize(
    "changes, phrase",
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias='all'"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"peft_type": "IA3"}, "unsupported peft_type 'IA3'"),
        ({"peft_type": None}, "unsupported peft_type"),
        ({"lora_bias": True}, "lora_bias"),
        ({"init_lora_weights": "pissa_niter_4"}, "path_initial_model_for_weight_conversion"),
        ({"layer_replication": [[0, 1], [0, 2]]}, "layer replication"),
        ({"target_parameters": ["mlp.experts.down_proj"]}, "target_parameters"),
        ({"alora_invocation_tokens": [1, 2]}, "activated LoRA"),
        ({"r": "eight"}, "r must be a positive integer"),
        ({"r": 0}, "r must be a positive integer"),
        ({"lora_alpha": "x"}, "lora_alpha must be a number"),
        ({"rank_pattern": {"q_proj": "x"}}, "rank_pattern must map"),
        ({"alpha_pattern": ["q_proj"]}, "alpha_pattern must map"),
        ({"target_modules": "(q_proj"}, "invalid regex"),
        ({"target_modules": 7}, "target_modules must be a list"),
        ({"layers_to_transform": "0"}, "layers_to_transform must be an integer"),
        (
            {"target_modules": ".*q_proj", "layers_to_transform": [0]},
            "cannot be used when target_modules is a regex",
        ),
        ({"layers_pattern": "layers"}, "layers_pattern is set but layers_to_transform is not"),
    ],
)
def test_refused_config(adapter, changes, phrase):
    edit_config(adapter, **changes)
    refused(adapter, phrase)


def test_target_modules_the_model_cannot_take(adapter):
    edit_config(adapter, target_modules=[*ALL_SEVEN, "c_attn", "fc1"])
    message = refused(adapter, "['c_attn', 'fc1'] cannot take LoRA on this model")
    assert "supported: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in message


def test_rank_disagrees_with_config(adapter):
    edit_config(adapter, r=2)
    refused(adapter, "has rank 4 in its tensors but the config implies r=2")


def test_rank_disagrees_with_rank_pattern(adapter):
    edit_config(adapter, rank_pattern={r"layers\.1\.mlp\.up_proj": 8})
    refused(adapter, "model.layers.1.mlp.up_proj' has rank 4 in its tensors but the config implies r=8")


@pytest.mark.parametrize(
    "changes",
    [
        {"target_modules": ["q_proj", "k_proj"]},
        {"layers_to_transform": [0]},
        {"exclude_modules": ["down_proj"]},
    ],
)
def test_weights_the_config_does_not_select(adapter, changes):
    edit_config(adapter, **changes)
    refused(adapter, "do not select (config and weights disagree)")


def test_rank_above_max_lora_rank(adapter):
    refused(adapter, "has rank 4, above max_lora_rank=2", max_lora_rank=2)


def _set(key, value):
    return lambda t: t.__setitem__(key, value)


def _rename(old: str, new: str):
    def fn(t):
        for k in [k for k in t if old in k]:
            t[k.replace(old, new)] = t.pop(k)

    return fn


@pytest.mark.parametrize(
    "edit, phrase",
    [
        (lambda t: t.pop(QB), "has lora_A but no lora_B (incomplete A/B pair)"),
        (lambda t: t.pop(QA), "has lora_B but no lora_A (incomplete A/B pair)"),
        (
            _set(QA, torch.randn(4, 31)),
            f"tensor {QA!r} does not fit the base model: expected [4, 32], got [4, 31]",
        ),
        (
            _set(QB, torch.randn(47, 4)),
            f"tensor {QB!r} does not fit the base model: expected [48, 4], got [47, 4]",
        ),
        (_set(QB, torch.randn(48, 3)), "rank mismatch"),
        (_set(QA, torch.full((4, 32), float("nan"))), "NaN or Inf"),
        (_set(QB, torch.full((48, 4), float("inf"))), "NaN or Inf"),
        (_set(QA, torch.ones(4, 32, dtype=torch.int32)), "must be floating point"),
        (_set(QA, torch.randn(4, 32, 1)), "must be a 2-D matrix"),
        (_set(QA, torch.randn(0, 32)), "rank mismatch"),
        (_rename("layers.1.", "layers.5."), "is for layer 5 but the base model has 2 layers"),
        (_set("some.other.tensor", torch.zeros(2)), "is not a recognised PEFT LoRA key"),
        (
            _set("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(2)),
            "not a recognised PEFT LoRA key",
        ),
        (_rename("self_attn.q_proj", "self_attn.qkv"), "target module 'qkv' is not supported by this model"),
        (_rename("self_attn.q_proj", "mlp.q_proj"), "is not a recognised module path"),
        (_rename("model.layers.0.self_attn.q_proj", "model.norm.q_proj"), "outside the decoder layers"),
        (_rename("model.layers.0.self_attn.q_proj", "lm_head"), "lm_head (lm_head) is not supported yet"),
        (_set("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(4, 64)), "embeddings"),
        (
            _set("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", torch.ones(48)),
            "DoRA",
        ),
        (_set("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", torch.ones(48)), "lora_bias"),
        (
            lambda t: t.__setitem__(QA.replace(".weight", ".default.weight"), t[QA].clone()),
            "has two lora_A tensors",
        ),
        (lambda t: t.clear() or t.__setitem__("__metadata_only__", torch.zeros(0)), "not a recognised"),
    ],
)
def test_refused_tensors(adapter, edit, phrase):
    edit_tensors(adapter, edit)
    refused(adapter, phrase)


def test_empty_weights_file(adapter):
    save_file({}, str(adapter / "adapter_model.safetensors"))
    refused(adapter, "holds no tensors")


def test_overflow_in_requested_dtype(adapter):
    edit_tensors(adapter, _set(QA, torch.full((4, 32), 1e6)))
    load_adapter(adapter, SPEC, max_lora_rank=8)  # finite in fp32
    refused(adapter, "NaN or Inf values (in torch.float16)", dtype=torch.float16)


def test_adapter_for_another_base_model(tmp_path):
    make_adapter(tmp_path, llama_config(), r=4, target_modules=["q_proj"])
    refused(
        tmp_path, "does not fit the base model: expected [4, 48], got [4, 32]", spec=lora_spec(qwen2_config())
    )


def test_vision_tower_refused(adapter):
    spec = lora_spec(llama_config(), refused_prefixes=(("model.visual", "vision tower"),))
    edit_tensors(
        adapter, _set("base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight", torch.zeros(4, 8))
    )
    refused(adapter, "LoRA on 'model.visual' (vision tower) is not supported", spec=spec)


# Real PEFT adapters with features we refuse (not hand-edited files)


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        ({"target_modules": ["q_proj", "lm_head"]}, "lm_head (lm_head) is not supported yet"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embeddings"),
        ({"target_modules": ["q_proj"], "use_dora": True}, "DoRA"),
        ({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj"], "bias": "lora_only"}, "bias='lora_only'"),
        ({"target_modules": ["q_proj"], "lora_bias": True}, "lora_bias"),
        ({"target_modules": ["q_proj"], "r": 16}, "has rank 16, above max_lora_rank=8"),
    ],
)
def test_refused_real_peft_adapters(tmp_path, kwargs, phrase):
    make_adapter(tmp_path, llama_config(), **kwargs)
    refused(tmp_path, phrase)
