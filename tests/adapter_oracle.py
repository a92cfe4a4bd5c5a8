"""Adapters saved by real PEFT models, and the oracle that checks a loaded adapter against PEFT's layers.

Shared by the loading tests (``tests/unit/test_adapter_loading.py``) and the refusal tests
(``tests/unit/test_adapter_refusals.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as PeftLoraLinear
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from mmlora.lora.adapter import LoadedAdapter
from mmlora.lora.spec import LoRAModelSpec, LoRATarget
from mmlora.models.families import DECODER_LORA_PARENTS

ALL_SEVEN = list(DECODER_LORA_PARENTS)


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
    return LoRAModelSpec(
        cfg.num_hidden_layers, targets, "model.layers", dict(DECODER_LORA_PARENTS), refused_prefixes
    )


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
