"""load_adapter against HF + PEFT: weights, per-module deltas (PEFT's own layer output), refusals.

The oracle: for every LoRA layer PEFT builds, the loaded A/B equal PEFT's tensors, and
``x @ A.T @ B.T * scaling`` equals PEFT's layer output minus its output with the adapter disabled.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as PeftLoraLinear
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from mmlora.lora.adapter import LoadedAdapter, load_adapter
from mmlora.lora.spec import LoRAModelSpec, LoRATarget

PARENTS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
ALL_SEVEN = list(PARENTS)


def lora_spec(cfg, refused_prefixes: tuple[tuple[str, str], ...] = ()) -> LoRAModelSpec:
    """What the model classes' ``lora_model_spec(hf_config)`` builds for a Llama-like config."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    targets = (
        LoRATarget("qkv_proj", ("q_proj", "k_proj", "v_proj"), h, (q, kv, kv)),
        LoRATarget("o_proj", ("o_proj",), q, (h,)),
        LoRATarget("gate_up_proj", ("gate_proj", "up_proj"), h, (inter, inter)),
        LoRATarget("down_proj", ("down_proj",), inter, (h,)),
    )
    return LoRAModelSpec(cfg.num_hidden_layers, targets, "model.layers", dict(PARENTS), refused_prefixes)


def llama_config() -> LlamaConfig:
    # head_dim * heads != hidden, so q/o shapes differ from hidden
    return LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, vocab_size=64,
    )  # fmt: skip


def qwen2_config() -> Qwen2Config:
    return Qwen2Config(
        hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64,
    )  # fmt: skip


def make_adapter(path: Path, cfg, seed: int = 0, safe: bool = True, **lora_kwargs):
    """A PEFT model with random (non-zero) A and B, saved to ``path``."""
    torch.manual_seed(seed)
    model_cls = Qwen2ForCausalLM if isinstance(cfg, Qwen2Config) else LlamaForCausalLM
    model = model_cls(cfg).eval()
    lora_kwargs.setdefault("init_lora_weights", False)  # PEFT's default zero B would hide scaling bugs
    peft_model = get_peft_model(model, LoraConfig(**lora_kwargs)).eval()
    peft_model.save_pretrained(str(path), safe_serialization=safe)
    return peft_model


def check_against_peft(peft_model, loaded: LoadedAdapter, spec: LoRAModelSpec, atol: float = 2e-5) -> int:
    """Every PEFT LoRA layer matches the loaded weights and delta; nothing else is loaded. Returns #modules."""
    seen: set[tuple[int, str, int]] = set()
    for name, mod in peft_model.named_modules():
        if not isinstance(mod, PeftLoraLinear) or "default" not in mod.lora_A:
            continue
        path = name.removeprefix("base_model.model.")
        parts = path.split(".")  # model.layers.<i>.<parent>.<module>
        layer, module = int(parts[2]), parts[-1]
        target, s = spec.find_slice(module)
        w = loaded.weights[(layer, target.name)]
        a_ref, b_ref = mod.lora_A["default"].weight.detach(), mod.lora_B["default"].weight.detach()
        torch.testing.assert_close(w.A[s], a_ref.to(w.A[s].dtype), rtol=0, atol=0)
        torch.testing.assert_close(w.B[s], b_ref.to(w.B[s].dtype), rtol=0, atol=0)
        x = torch.randn(3, target.in_features)
        with torch.no_grad():
            with_lora = mod(x)
            with peft_model.disable_adapter():
                base = mod(x)
        ours = (x.double() @ w.A[s].double().T @ w.B[s].double().T * w.scalings[s]).float()
        torch.testing.assert_close(ours, with_lora - base, rtol=1e-4, atol=atol)
        assert w.scalings[s] == pytest.approx(mod.scaling["default"])
        seen.add((layer, target.name, s))
    for (layer, tname), w in loaded.weights.items():
        for s, a in enumerate(w.A):
            assert (a is None) == ((layer, tname, s) not in seen)
            assert (w.B[s] is None) == (a is None)
            assert (w.scalings[s] == 0.0) == (a is None)
    assert seen, "PEFT built no LoRA layer"
    return len(seen)


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
