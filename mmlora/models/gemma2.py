"""Gemma 2 decoder, computed as HF's ``Gemma2ForCausalLM``: the Llama classes with Gemma's pieces.

Differences from Llama: embeddings scaled by sqrt(hidden) (the scale rounded to the model dtype first,
as HF does), RMSNorm with (1 + weight) in fp32, norms before *and after* attention and the MLP, GeGLU
with tanh GELU, attention scale ``query_pre_attn_scalar ** -0.5``, attention logit soft-capping,
final logit soft-capping, sliding-window attention on the layers ``config.layer_types`` marks, and
tied embeddings: all of it read from the typed :class:`~mmlora.models.arch_config.ArchConfig` (the
attention and the logits need no code of their own). LoRA targets and packing are Llama's (q/k/v ->
qkv_proj, gate/up -> gate_up_proj).
"""

from __future__ import annotations

import torch

from mmlora.forward.batch import ForwardBatch
from mmlora.layers.fused_ops import gelu_tanh_and_mul
from mmlora.layers.norms import RMSNorm
from mmlora.models.arch_config import ArchConfig
from mmlora.models.families import GEMMA2
from mmlora.models.llama import GatedMLP, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

_TANH_GELUS = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


def gemma2_mlp(cfg: ArchConfig) -> GatedMLP:
    if cfg.hidden_act not in _TANH_GELUS:
        raise ValueError(f"hidden_activation {cfg.hidden_act!r} is not supported for Gemma2 (tanh GELU only)")
    return GatedMLP(cfg, gelu_tanh_and_mul)


class Gemma2DecoderLayer(LlamaDecoderLayer):
    """Sandwich-norm block in the fused residual form (see :class:`~mmlora.models.llama.LlamaDecoderLayer`):
    the attention branch's residual add happens inside ``pre_feedforward_layernorm``, the MLP branch's
    inside the next layer's ``input_layernorm`` (or the final norm)."""

    norm_offset = 1.0
    make_mlp = staticmethod(gemma2_mlp)

    def __init__(self, cfg: ArchConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.norm_offset)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.norm_offset)

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(delta, residual) after this layer; ``residual`` None: ``hidden`` is the whole hidden state."""
        hidden, residual = self.input_layernorm.add_norm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, batch))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2Model(LlamaModel):
    layer_cls = Gemma2DecoderLayer

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__(cfg)
        # HF keeps sqrt(hidden) as an fp32 scalar and rounds it to the weight dtype before multiplying.
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5), persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden * self.embed_scale.to(hidden.dtype)


class Gemma2ForCausalLM(LlamaForCausalLM):
    hf_architectures = GEMMA2.hf_architectures
    hf_model_types = GEMMA2.hf_model_types
    lora_module_parents = dict(GEMMA2.lora_module_parents)
    model_cls = Gemma2Model
