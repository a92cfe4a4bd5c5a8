"""load_adapter against HF + PEFT: weights and per-module deltas (PEFT's own layer output).

The oracle (``tests/adapter_oracle.py``): for every LoRA layer PEFT builds, the loaded A/B equal PEFT's
tensors, and ``x @ A.T @ B.T * scaling`` equals PEFT's layer output minus its output with the adapter
disabled. What the loader refuses is tested in ``test_adapter_refusals.py``.
"""

from __future__ import annotations

import pytest
import torch
from adapter_oracle import ALL_SEVEN, check_against_peft, llama_config, lora_spec, make_adapter, qwen2_config
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import Qwen2ForCausalLM

from mmlora.lora.adapter import load_adapter


@pytest.mark.parametrize("make_config", [llama_config, qwen2_config])
def test_spec_helper_matches_model_class(make_config):
    """The oracle spec used here is the one the engine's model class builds."""
    from mmlora.models.llama import LlamaForCausalLM as OurLlama

    cfg = make_config()
    assert OurLlama(cfg).lora_model_spec() == lora_spec(cfg)


# ---------------------------------------------------------------------------------------------------------
# Faithful loading


def test_attention_list_targets_llama(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(
        tmp_path, cfg, r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=8)
    assert check_against_peft(peft_model, loaded, spec) == 2 * 4
    assert loaded.rank == 4 and loaded.path == str(tmp_path)
    assert set(loaded.weights) == {(i, t) for i in range(2) for t in ("qkv_proj", "o_proj")}
    assert loaded.config["peft_type"] == "LORA"
    assert loaded.nbytes == sum(
        t.numel() * t.element_size() for w in loaded.weights.values() for t in (*w.A, *w.B) if t is not None
    )


def test_all_seven_projections_qwen2(tmp_path):
    cfg = qwen2_config()
    peft_model = make_adapter(tmp_path, cfg, r=8, lora_alpha=16, target_modules=ALL_SEVEN)
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=8)
    assert check_against_peft(peft_model, loaded, spec) == 2 * 7
    assert all(w.scalings == tuple(2.0 for _ in w.A) for w in loaded.weights.values())


def test_all_linear_targets(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(tmp_path, cfg, r=2, lora_alpha=3, target_modules="all-linear")
    spec = lora_spec(cfg)
    assert check_against_peft(peft_model, load_adapter(tmp_path, spec, max_lora_rank=4), spec) == 14


def test_regex_string_targets(tmp_path):
    cfg = llama_config()
    regex = r".*\.layers\.1\.(self_attn\.(q|v)_proj|mlp\.down_proj)"
    peft_model = make_adapter(tmp_path, cfg, r=4, lora_alpha=4, target_modules=regex)
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=16)
    assert check_against_peft(peft_model, loaded, spec) == 3
    qkv = loaded.weights[(1, "qkv_proj")]
    assert qkv.A[1] is None and qkv.A[0] is not None and qkv.A[2] is not None
    assert set(loaded.weights) == {(1, "qkv_proj"), (1, "down_proj")}


def test_rank_and_alpha_patterns(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(
        tmp_path, cfg, r=4, lora_alpha=8, target_modules=ALL_SEVEN,
        rank_pattern={"q_proj": 8, r"layers\.1\.mlp\.down_proj": 2, "gate_proj": 6},
        alpha_pattern={"v_proj": 3, r"model\.layers\.0\.mlp\.up_proj": 32},
    )  # fmt: skip
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=8)
    check_against_peft(peft_model, loaded, spec)
    assert loaded.rank == 8
    assert loaded.weights[(1, "down_proj")].A[0].shape[0] == 2
    assert loaded.weights[(0, "down_proj")].A[0].shape[0] == 4
    assert loaded.weights[(0, "qkv_proj")].scalings == (1.0, 2.0, 0.75)
    assert loaded.weights[(0, "gate_up_proj")].scalings == (8 / 6, 8.0)
    assert loaded.weights[(1, "gate_up_proj")].scalings == (8 / 6, 2.0)


def test_rslora(tmp_path):
    cfg = qwen2_config()
    peft_model = make_adapter(tmp_path, cfg, r=16, lora_alpha=8, use_rslora=True, target_modules=ALL_SEVEN)
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=16)
    check_against_peft(peft_model, loaded, spec)
    assert loaded.weights[(0, "o_proj")].scalings == (2.0,)


def test_rslora_with_patterns(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(
        tmp_path, cfg, r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "down_proj"],
        rank_pattern={"down_proj": 9}, alpha_pattern={"q_proj": 5},
    )  # fmt: skip
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=16)
    check_against_peft(peft_model, loaded, spec)
    assert loaded.weights[(0, "down_proj")].scalings == (8 / 3,)
    assert loaded.weights[(0, "qkv_proj")].scalings == (2.5, 0.0, 0.0)


@pytest.mark.parametrize("layers_pattern", [None, "layers"])
def test_layers_to_transform(tmp_path, layers_pattern):
    cfg = llama_config()
    peft_model = make_adapter(
        tmp_path, cfg, r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], layers_to_transform=[1],
        layers_pattern=layers_pattern,
    )  # fmt: skip
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=8)
    assert check_against_peft(peft_model, loaded, spec) == 2
    assert set(loaded.weights) == {(1, "qkv_proj"), (1, "gate_up_proj")}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": ALL_SEVEN,
         "rank_pattern": {"k_proj": 2, "up_proj": 6}, "alpha_pattern": {"o_proj": 3}},
        {"r": 3, "lora_alpha": 5, "target_modules": r".*\.(v_proj|gate_proj)"},
        {"r": 3, "lora_alpha": 5, "target_modules": ["v_proj", "gate_proj"], "layers_to_transform": 1},
    ],
)  # fmt: skip
def test_matches_peft_from_pretrained(tmp_path, kwargs):
    """The serving oracle: PEFT re-reading the saved folder (not the in-memory training model)."""
    cfg = qwen2_config()
    make_adapter(tmp_path, cfg, **kwargs)
    reloaded = PeftModel.from_pretrained(Qwen2ForCausalLM(cfg), str(tmp_path)).eval()
    spec = lora_spec(cfg)
    check_against_peft(reloaded, load_adapter(tmp_path, spec, max_lora_rank=8), spec)


def test_fp16_dtype(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(tmp_path, cfg, r=4, lora_alpha=8, target_modules=ALL_SEVEN)
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=8, dtype=torch.float16)
    assert all(
        t.dtype == torch.float16 for w in loaded.weights.values() for t in (*w.A, *w.B) if t is not None
    )
    check_against_peft(peft_model, loaded, spec, atol=5e-3)
    fp32 = load_adapter(tmp_path, spec, max_lora_rank=8)
    assert loaded.nbytes * 2 == fp32.nbytes


def test_pickled_adapter_when_allowed(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(
        tmp_path, cfg, safe=False, r=4, lora_alpha=8, target_modules=["v_proj", "o_proj"]
    )
    assert (tmp_path / "adapter_model.bin").exists() and not (tmp_path / "adapter_model.safetensors").exists()
    spec = lora_spec(cfg)
    check_against_peft(peft_model, load_adapter(tmp_path, spec, max_lora_rank=8, allow_pickled=True), spec)


def test_old_style_default_adapter_names(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(tmp_path, cfg, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    file = tmp_path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    renamed = {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}
    save_file(renamed, str(file))
    spec = lora_spec(cfg)
    check_against_peft(peft_model, load_adapter(tmp_path, spec, max_lora_rank=8), spec)


def test_pattern_first_match_wins_and_exclude_modules(tmp_path):
    cfg = qwen2_config()
    peft_model = make_adapter(
        tmp_path, cfg, r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=["down_proj"],
        rank_pattern={r"layers\.0\.self_attn\.q_proj": 6, "q_proj": 2}, alpha_pattern={r".*\.1\..*_proj": 1},
    )  # fmt: skip
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=8)
    assert check_against_peft(peft_model, loaded, spec) == 2 * 6
    assert [loaded.weights[(i, "qkv_proj")].A[0].shape[0] for i in range(2)] == [6, 2]
    assert not any(t == "down_proj" for _, t in loaded.weights)
    assert loaded.weights[(1, "o_proj")].scalings == (0.25,)


def test_exclude_modules_regex(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(
        tmp_path, cfg, r=4, lora_alpha=8, target_modules=ALL_SEVEN, exclude_modules=r".*\.0\.mlp\..*"
    )
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=8)
    assert check_against_peft(peft_model, loaded, spec) == 7 + 4


def test_bfloat16_and_rank_bound_inclusive(tmp_path):
    cfg = llama_config()
    make_adapter(tmp_path, cfg, r=8, lora_alpha=8, target_modules=["o_proj"])
    loaded = load_adapter(tmp_path, lora_spec(cfg), max_lora_rank=8, dtype=torch.bfloat16)
    assert loaded.rank == 8 and loaded.weights[(0, "o_proj")].A[0].dtype == torch.bfloat16


def test_selected_module_without_weights_gets_no_delta(tmp_path, caplog):
    """PEFT keeps its init (zero B by default) for a selected module absent from the file: no delta."""
    cfg = llama_config()
    make_adapter(tmp_path, cfg, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    file = tmp_path / "adapter_model.safetensors"
    tensors = {k: v for k, v in load_file(str(file)).items() if "layers.1.self_attn.v_proj" not in k}
    save_file(tensors, str(file))
    with caplog.at_level("WARNING", logger="mmlora.lora.adapter"):
        loaded = load_adapter(tmp_path, lora_spec(cfg), max_lora_rank=8)
    assert "model.layers.1.self_attn.v_proj" in caplog.text
    assert loaded.weights[(1, "qkv_proj")].A[2] is None and loaded.weights[(1, "qkv_proj")].scalings[2] == 0.0
    assert loaded.weights[(0, "qkv_proj")].A[2] is not None
