"""What a model offers to LoRA: its target modules as data, derived from the model class and config.

A model class declares (see ``mmlora.models``):
  ``packed_modules_mapping``  {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
  ``lora_module_parents``     {"q_proj": "self_attn", ..., "down_proj": "mlp"}: where each HF module sits in a layer
  ``lora_layers_prefix``      "model.layers": the HF path of the decoder layers
and builds a ``LoRAModelSpec`` from its config with the in/out sizes of every target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import nn


@dataclass(frozen=True)
class LoRATarget:
    """One (possibly packed) linear of every decoder layer that takes LoRA.

    name          our module's name, e.g. "qkv_proj"
    slices        the HF module names packed into it, in output order, e.g. ("q_proj", "k_proj", "v_proj")
    in_features   input size
    out_features  output size of each slice
    """

    name: str
    slices: tuple[str, ...]
    in_features: int
    out_features: tuple[int, ...]

    @property
    def slice_offsets(self) -> tuple[int, ...]:
        offsets = [0]
        for n in self.out_features:
            offsets.append(offsets[-1] + n)
        return tuple(offsets)


@dataclass(frozen=True)
class LoRAModelSpec:
    """Everything adapter loading needs to know about the base model.

    num_layers          decoder layers
    targets             the packed targets, identical for every layer
    layers_prefix       HF path of the decoder layers ("model.layers"); a PEFT key reads
                        ``base_model.model.<layers_prefix>.<i>.<parent>.<module>.lora_A.weight``
    module_parents      HF module name -> its parent path inside a layer ("q_proj" -> "self_attn")
    refused_prefixes    HF paths of towers that take no LoRA (e.g. "model.visual"), each with the reason
    """

    num_layers: int
    targets: tuple[LoRATarget, ...]
    layers_prefix: str
    module_parents: dict[str, str]
    refused_prefixes: tuple[tuple[str, str], ...] = ()

    def find_slice(self, module: str) -> tuple[LoRATarget, int] | None:
        """HF module name ("k_proj") -> (its packed target, slice index), or None if it takes no LoRA."""
        for target in self.targets:
            if module in target.slices:
                return target, target.slices.index(module)
        return None

    @property
    def module_names(self) -> tuple[str, ...]:
        return tuple(m for t in self.targets for m in t.slices)


class LoRATargetModel(Protocol):
    """What the LoRA manager needs of a model (``mmlora.models.base.CausalLM`` provides it): its decoder
    layers, where each target sits in a layer, and its spec. A protocol, so that lora never imports
    models (models sit above lora in the layer order)."""

    layers: Sequence[nn.Module]
    lora_target_paths: dict[str, str]

    def lora_model_spec(self, full: bool = True) -> LoRAModelSpec: ...
