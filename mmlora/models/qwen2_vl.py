"""Qwen2-VL (``Qwen2VLForConditionalGeneration``): a Qwen2 language tower with M-RoPE, fed by a vision tower.

The class holds the two towers only. The request work (prompt expansion, the image processor, M-RoPE
positions, the lifetime of each request's vision features) is :mod:`mmlora.multimodal`'s; per forward
it calls :meth:`encode_images` and hands the language tower positions [3, T] and the image rows'
features in the ForwardBatch. LoRA applies to the language tower only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmlora.forward.batch import ForwardBatch
from mmlora.models.base import CausalLM
from mmlora.models.families import QWEN2_VL
from mmlora.models.llama import LlamaForCausalLM, LlamaModel
from mmlora.models.qwen2_vl_vision import Qwen2VLVisionTower


class Qwen2VLForConditionalGeneration(CausalLM):
    hf_architectures = QWEN2_VL.hf_architectures
    hf_model_types = QWEN2_VL.hf_model_types
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    lora_module_parents = dict(QWEN2_VL.lora_module_parents)
    lora_target_paths = LlamaForCausalLM.lora_target_paths
    lora_layers_prefix = "model.language_model.layers"
    lora_refused_prefixes = (
        ("model.visual", "the vision tower"),
        ("visual", "the vision tower"),
        ("model.language_model.embed_tokens", "the token embeddings"),
    )
    is_multimodal = QWEN2_VL.is_multimodal

    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config)
        vision = self.arch.vision
        if vision is None:
            raise ValueError("Qwen2-VL: the config has no vision_config")
        if vision.out_hidden_size != self.arch.hidden_size:
            raise ValueError(
                f"vision_config.hidden_size {vision.out_hidden_size} != text hidden_size "
                f"{self.arch.hidden_size}"
            )
        self.model = LlamaModel(self.arch)  # M-RoPE: the config's mrope_section picks MRotaryEmbedding
        self.visual = Qwen2VLVisionTower(vision)
        self.lm_head = self.make_lm_head(self.model.embed_tokens)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def encode_images(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """Patches [N, C * tp * p * p] (any device, any float dtype) of images with patch grids ``grid_thw``
        -> merged features [N / merge**2, hidden], one per ``<|image_pad|>`` token, in image order."""
        weight = self.visual.patch_embed.proj.weight
        return self.visual(pixels.to(device=weight.device, dtype=weight.dtype), grid_thw)

    def map_weight_name(self, name: str) -> tuple[str, int | None]:
        # transformers >= 5 names the towers model.language_model / model.visual; checkpoints on disk
        # (and our modules) use model.* / visual.*.
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        elif name.startswith("model.visual."):
            name = name[len("model.") :]
        return super().map_weight_name(name)
