"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2): GQA, RoPE (incl. llama3 scaling), qkv bias
for Qwen2, tied embeddings, sliding-window attention where the config sets it. Reads its typed
:class:`~mmlora.models.arch_config.ArchConfig`.

Our own implementation over a ForwardBatch and the paged KV cache; HF checkpoint names map onto our
packed modules through the class-level data below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from mmlora.forward.batch import ForwardBatch
from mmlora.layers.attention import AttentionBackend
from mmlora.layers.fused_ops import silu_and_mul
from mmlora.layers.norms import RMSNorm
from mmlora.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from mmlora.layers.rotary import MRotaryEmbedding, RotaryEmbedding, share_rotary
from mmlora.models.arch_config import ArchConfig
from mmlora.models.base import CausalLM
from mmlora.models.families import LLAMA


class LlamaAttention(nn.Module):
    """Packed-qkv self-attention over the paged KV cache. What differs between the families is config:
    biases, scale (``query_pre_attn_scalar``), the layer's sliding window, logit soft-cap and M-RoPE."""

    def __init__(self, cfg: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        heads, kv_heads = (cfg.num_attention_heads, self.head_dim), (cfg.num_key_value_heads, self.head_dim)
        # This rank's heads (all of them at tp_size 1); KV heads replicated when fewer than the ranks.
        names = ("num_attention_heads", "num_key_value_heads", "num_key_value_heads")
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, (heads, kv_heads, kv_heads), cfg.qkv_bias, names
        )
        self.o_proj = RowParallelLinear(heads, cfg.hidden_size, cfg.o_proj_bias, "num_attention_heads")
        self.q_size, self.kv_size = self.qkv_proj.output_sizes[:2]
        self.num_heads = self.q_size // self.head_dim
        self.num_kv_heads = self.kv_size // self.head_dim
        rotary = MRotaryEmbedding if cfg.rope.mrope_section is not None else RotaryEmbedding
        self.rotary = rotary(self.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.scale = cfg.attention_scale
        self.sliding_window = cfg.sliding_windows[layer_idx]
        self.logit_softcap = cfg.attn_logit_softcap
        self.layer_idx = layer_idx
        self.backend: AttentionBackend | None = None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(batch.positions, q, k)
        o = self.backend.forward(
            q,
            k,
            v,
            self.k_cache,
            self.v_cache,
            batch.attn,
            scale=self.scale,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
        )
        return self.o_proj(o.reshape(T, self.q_size))


class GatedMLP(nn.Module):
    """``down(act(gate) * up)`` with gate and up packed in one ``gate_up_proj`` (the LoRA target layout);
    ``act_and_mul`` is a fused op of :mod:`mmlora.layers.fused_ops`. Llama uses SiLU, Gemma2 tanh GELU."""

    def __init__(self, cfg: ArchConfig, act_and_mul: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.act_and_mul = act_and_mul
        inter, names = (cfg.intermediate_size, 1), ("intermediate_size", "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, (inter, inter), cfg.mlp_bias, names)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, "intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A LoRA gate_up may leave its expand to the activation, which reads its output anyway.
        deferred = getattr(self.gate_up_proj, "forward_deferred", None)
        if deferred is None:
            return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        gate_up, lora = deferred(x)
        return self.down_proj(self.act_and_mul(gate_up, lora))


def llama_mlp(cfg: ArchConfig) -> GatedMLP:
    if cfg.hidden_act != "silu":
        raise ValueError(
            f"hidden_act {cfg.hidden_act!r} is not supported for Llama-family models (silu only)"
        )
    return GatedMLP(cfg, silu_and_mul)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block in the fused residual form (as vLLM): a layer takes the previous layer's output
    delta and the running residual, and returns its own; the residual add happens inside the next norm
    (one kernel on CUDA). The hidden state after the layer is ``delta + residual``."""

    norm_offset: ClassVar[float] = 0.0  # RMSNorm scales by (offset + weight)
    make_mlp: ClassVar[Callable[[ArchConfig], GatedMLP]] = staticmethod(llama_mlp)

    def __init__(self, cfg: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = self.make_mlp(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.norm_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.norm_offset)

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(delta, residual) after this layer; ``residual`` None: ``hidden`` is the whole hidden state."""
        hidden, residual = self.input_layernorm.add_norm(hidden, residual)
        hidden = self.self_attn(hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embeddings, the decoder layers and the final norm; a family swaps the layer class and norm offset
    (and may scale the embeddings: ``embed``)."""

    layer_cls: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_hidden_layers))
        share_rotary(self.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.layer_cls.norm_offset)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed(batch.input_ids)
        if batch.input_embeds is not None:
            hidden = hidden.index_copy(0, batch.embed_rows, batch.input_embeds.to(hidden.dtype))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, batch, residual)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class LlamaForCausalLM(CausalLM):
    hf_architectures = LLAMA.hf_architectures
    hf_model_types = LLAMA.hf_model_types
    packed_modules_mapping = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    lora_module_parents = dict(LLAMA.lora_module_parents)
    lora_target_paths = {
        "qkv_proj": "self_attn.qkv_proj",
        "o_proj": "self_attn.o_proj",
        "gate_up_proj": "mlp.gate_up_proj",
        "down_proj": "mlp.down_proj",
    }
    lora_layers_prefix = "model.layers"
    model_cls: ClassVar[type[LlamaModel]] = LlamaModel

    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config)
        self.model = self.model_cls(self.arch)
        self.lm_head = self.make_lm_head(self.model.embed_tokens)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers
