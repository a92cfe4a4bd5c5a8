"""HF config -> our model class; unsupported architectures are refused with the list.

The table is :mod:`mmlora.models.families` (no torch); a class is imported when a model is built."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mmlora.models.families import family_for, supported_architectures

if TYPE_CHECKING:
    from mmlora.models.base import CausalLM

__all__ = ["model_class_for", "supported_architectures"]


def model_class_for(hf_config: Any) -> type[CausalLM]:
    family = family_for(hf_config)
    return getattr(importlib.import_module(family.module), family.class_name)
