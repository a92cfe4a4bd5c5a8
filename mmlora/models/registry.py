"""HF architecture name -> our model class; unsupported architectures are refused with the list."""

from __future__ import annotations

from typing import Any

from mmlora.models.base import CausalLM
from mmlora.models.gemma2 import Gemma2ForCausalLM
from mmlora.models.llama import LlamaForCausalLM
from mmlora.models.qwen2_vl import Qwen2VLForConditionalGeneration

_MODEL_CLASSES: tuple[type[CausalLM], ...] = (
    LlamaForCausalLM,
    Gemma2ForCausalLM,
    Qwen2VLForConditionalGeneration,
)


def supported_architectures() -> list[str]:
    return sorted(a for cls in _MODEL_CLASSES for a in cls.hf_architectures)


def model_class_for(hf_config: Any) -> type[CausalLM]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        for cls in _MODEL_CLASSES:
            if arch in cls.hf_architectures:
                return cls
    if not archs:  # GGUF configs carry only the model type
        model_type = getattr(hf_config, "model_type", None)
        for cls in _MODEL_CLASSES:
            if model_type in cls.hf_model_types:
                return cls
    raise ValueError(
        f"unsupported model architecture {archs or getattr(hf_config, 'model_type', '?')}; "
        f"supported: {', '.join(supported_architectures())}"
    )
