"""Gemma 2 decoder, computed as HF's ``Gemma2ForCausalLM``.

Differences from Llama: embeddings scaled by sqrt(hidden) (the scale rounded to the model dtype first,
as HF does), RMSNorm with (1 + weight) in fp32, norms before *and after* attention and the MLP, GeGLU
with tanh GELU, attention scale ``query_pre_attn_scalar ** -0.5``, attention logit soft-capping,
final logit soft-capping, sliding-window attention on the layers ``config.layer_types`` marks, and
tied embeddings: all of it read from the typed :class:`~mmlora.models.arch_config.ArchConfig`. LoRA
targets and packing are Llama's (q/k/v -> qkv_proj, gate/up -> gate_up_proj).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmlora.forward.batch import ForwardBatch
from mmlora.layers.fused_ops import gelu_tanh_and_mul
from mmlora.layers.norms import RMSNorm
from mmlora.layers.rotary import share_rotary
from mmlora.models.arch_config import ArchConfig
from mmlora.models.base import CausalLM
from mmlora.models.families import GEMMA2
from mmlora.models.llama import GatedMLP, LlamaAttention, LlamaForCausalLM

_TANH_GELUS = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


def gemma2_mlp(cfg: ArchConfig) -> GatedMLP:
    if cfg.hidden_act not in _TANH_GELUS:
        raise ValueError(f"hidden_activation {cfg.hidden_act!r} is not supported for Gemma2 (tanh GELU only)")
    return GatedMLP(cfg, gelu_tanh_and_mul)


class Gemma2DecoderLayer(nn.Module):
    """Sandwich-norm block in the fused residual form (see :class:`~mmlora.models.llama.LlamaDecoderLayer`):
    the attention branch's residual add happens inside ``pre_feedforward_layernorm``, the MLP branch's
    inside the next layer's ``input_layernorm`` (or the final norm)."""

    def __init__(self, cfg: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = gemma2_mlp(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(delta, residual) after this layer; ``residual`` None: ``hidden`` is the whole hidden state."""
        hidden, residual = self.input_layernorm.add_norm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, batch))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2Model(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma2DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        share_rotary(self.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        # HF keeps sqrt(hidden) as an fp32 scalar and rounds it to the weight dtype before multiplying.
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5), persistent=False)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)
        hidden = hidden * self.embed_scale.to(hidden.dtype)
        if batch.input_embeds is not None:
            hidden = hidden.index_copy(0, batch.embed_rows, batch.input_embeds.to(hidden.dtype))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, batch, residual)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class Gemma2ForCausalLM(CausalLM):
    hf_architectures = GEMMA2.hf_architectures
    hf_model_types = GEMMA2.hf_model_types
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    lora_module_parents = dict(GEMMA2.lora_module_parents)
    lora_target_paths = LlamaForCausalLM.lora_target_paths
    lora_layers_prefix = "model.layers"

    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config)
        self.model = Gemma2Model(self.arch)
        self.lm_head = self.make_lm_head(self.model.embed_tokens)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers
