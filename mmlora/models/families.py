"""The supported model families as data that needs no torch: which HF configs each serves and its LoRA
facts that configuration checks read (:mod:`mmlora.preflight` answers in milliseconds, before torch is
imported). Each model class takes these fields from its family, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

DECODER_LORA_PARENTS: Mapping[str, str] = MappingProxyType(
    {
        "q_proj": "self_attn",
        "k_proj": "self_attn",
        "v_proj": "self_attn",
        "o_proj": "self_attn",
        "gate_proj": "mlp",
        "up_proj": "mlp",
        "down_proj": "mlp",
    }
)


@dataclass(frozen=True)
class ModelFamily:
    """module, class_name: where the model class lives (imported only to build a model)."""

    module: str
    class_name: str
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    is_multimodal: bool = False
    # HF module name -> its parent inside a decoder layer: the modules that can take LoRA.
    lora_module_parents: Mapping[str, str] = field(default_factory=lambda: DECODER_LORA_PARENTS)


# module, class, HF architectures, HF model types (GGUF configs give only these), multimodal
LLAMA = ModelFamily("mmlora.models.llama", "LlamaForCausalLM",
                    ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"), ("llama", "mistral", "qwen2"))  # fmt: skip
GEMMA2 = ModelFamily("mmlora.models.gemma2", "Gemma2ForCausalLM", ("Gemma2ForCausalLM",), ("gemma2",))
QWEN2_VL = ModelFamily("mmlora.models.qwen2_vl", "Qwen2VLForConditionalGeneration",
                       ("Qwen2VLForConditionalGeneration",), ("qwen2_vl",), is_multimodal=True)  # fmt: skip
FAMILIES: tuple[ModelFamily, ...] = (LLAMA, GEMMA2, QWEN2_VL)


def supported_architectures() -> list[str]:
    return sorted(a for family in FAMILIES for a in family.hf_architectures)


def family_for(hf_config: Any) -> ModelFamily:
    """The family serving ``hf_config`` (its ``architectures``, else its ``model_type`` as GGUF gives)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        for family in FAMILIES:
            if arch in family.hf_architectures:
                return family
    if not archs:  # GGUF configs carry only the model type
        model_type = getattr(hf_config, "model_type", None)
        for family in FAMILIES:
            if model_type in family.hf_model_types:
                return family
    raise ValueError(
        f"unsupported model architecture {archs or getattr(hf_config, 'model_type', '?')}; "
        f"supported: {', '.join(supported_architectures())}"
    )
