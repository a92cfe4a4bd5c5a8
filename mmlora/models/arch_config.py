"""ArchConfig: a model's architecture, read from its HF config once and typed (as mini-sglang's
``ModelConfig.from_hf``). Model code, the engine's set-up and the benchmarks read these fields; no other
code reads the HF config's attributes with defaults.

Named ``ArchConfig`` because :class:`mmlora.config.ModelConfig` already names the engine's model options
(which checkpoint, dtype, device). A vision-language config's ``text_config`` gives the language fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmlora.layers.rotary import RopeConfig

SLIDING, FULL = "sliding_attention", "full_attention"
# Families whose q/k/v projections always carry a bias, whatever ``attention_bias`` says.
_QKV_BIAS_TYPES = ("qwen2", "qwen2_vl", "qwen2_vl_text")
DEFAULT_MROPE_SECTION = (16, 24, 24)
_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class VisionConfig:
    """A Qwen2-VL vision tower, and the text tokens that mark images in a prompt."""

    depth: int
    """Number of vision transformer blocks."""
    embed_dim: int
    """Width of the vision blocks."""
    num_heads: int
    """Attention heads of a vision block."""
    mlp_ratio: float
    """MLP width / ``embed_dim``."""
    hidden_act: str
    """Activation of the vision MLP."""
    in_channels: int
    """Image channels (3: RGB)."""
    patch_size: int
    """Side of a square patch, in pixels."""
    temporal_patch_size: int
    """Frames per patch (images are repeated to fill it)."""
    spatial_merge_size: int
    """Side of the block of patches merged into one text token."""
    out_hidden_size: int
    """Width of a merged image feature: the language model's hidden size."""
    rope_theta: float
    """Base of the vision tower's 2-D rotary frequencies."""
    image_token_id: int
    """``<|image_pad|>``: one per merged image feature in an expanded prompt."""
    vision_start_token_id: int
    """``<|vision_start|>``, written before an image's pads."""
    vision_end_token_id: int
    """``<|vision_end|>``, written after an image's pads."""


@dataclass(frozen=True)
class ArchConfig:
    """The language model's architecture, normalised once from the HF config."""

    model_type: str
    """HF ``model_type`` (``llama``, ``mistral``, ``qwen2``, ``gemma2``, ``qwen2_vl``)."""
    vocab_size: int
    """Rows of the token embedding and of the logits."""
    num_hidden_layers: int
    """Decoder layers."""
    hidden_size: int
    """Width of the residual stream."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (GQA); equal to the query heads when the config gives none."""
    head_dim: int
    """Width of one head: the config's ``head_dim``, else hidden_size / num_attention_heads."""
    intermediate_size: int
    """Width of the gated MLP."""
    max_position_embeddings: int
    """Longest context the rotary tables cover (4096 when the config gives none)."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope: RopeConfig
    """Rotary settings: theta, scaling (linear, llama3) and M-RoPE sections."""
    sliding_windows: tuple[int | None, ...]
    """Per layer: the sliding attention window in tokens, or None for full attention."""
    attn_logit_softcap: float | None
    """Attention scores become ``cap * tanh(s / cap)`` (Gemma2); None: no cap."""
    final_logit_softcap: float | None
    """Logits become ``cap * tanh(l / cap)`` (Gemma2); None: no cap."""
    query_pre_attn_scalar: float | None
    """Attention scale is this ** -0.5 (Gemma2); None: head_dim ** -0.5."""
    tie_word_embeddings: bool
    """The LM head shares the token embedding's weight."""
    qkv_bias: bool
    """The q/k/v projections have a bias (``attention_bias``, or always for Qwen2)."""
    o_proj_bias: bool
    """The output projection has a bias (``attention_bias``)."""
    mlp_bias: bool
    """The MLP projections have a bias (``mlp_bias``)."""
    hidden_act: str
    """MLP activation (``hidden_activation`` where the config has it, as Gemma2's, else ``hidden_act``)."""
    eos_token_ids: tuple[int, ...]
    """End-of-sequence token ids of the config (the tokenizer may add its own)."""
    vision: VisionConfig | None = None
    """The vision tower of a vision-language model; None for a text-only model."""

    @property
    def attention_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        return float(base) ** -0.5

    @classmethod
    def from_hf(cls, hf_config: Any) -> ArchConfig:
        """Read ``hf_config`` (a transformers config, or any object with its attributes) once."""
        text = getattr(hf_config, "text_config", None) or hf_config
        model_type = str(getattr(hf_config, "model_type", "") or "")
        heads = int(text.num_attention_heads)
        attention_bias = bool(_opt(text, "attention_bias", False))
        gemma = model_type == "gemma2"
        return cls(
            model_type=model_type,
            vocab_size=int(text.vocab_size),
            num_hidden_layers=int(text.num_hidden_layers),
            hidden_size=int(text.hidden_size),
            num_attention_heads=heads,
            num_key_value_heads=int(_opt(text, "num_key_value_heads", heads)),
            head_dim=int(_opt(text, "head_dim", text.hidden_size // heads)),
            intermediate_size=int(text.intermediate_size),
            max_position_embeddings=int(_opt(text, "max_position_embeddings", 4096)),
            rms_norm_eps=float(_opt(text, "rms_norm_eps", 1e-6)),
            rope=_rope(text, model_type),
            sliding_windows=_sliding_windows(text, model_type),
            attn_logit_softcap=_cap(_opt(text, "attn_logit_softcapping", None)),
            final_logit_softcap=_cap(_opt(text, "final_logit_softcapping", None)),
            query_pre_attn_scalar=_float_or_none(_opt(text, "query_pre_attn_scalar", None)),
            tie_word_embeddings=bool(_opt(hf_config, "tie_word_embeddings", gemma)),
            qkv_bias=attention_bias or model_type in _QKV_BIAS_TYPES,
            o_proj_bias=attention_bias,
            mlp_bias=bool(_opt(text, "mlp_bias", False)),
            hidden_act=str(
                _opt(text, "hidden_activation", None)
                or _opt(text, "hidden_act", "gelu_pytorch_tanh" if gemma else "silu")
            ),
            eos_token_ids=_ids(_opt(text, "eos_token_id", None)),
            vision=_vision(hf_config) if getattr(hf_config, "vision_config", None) is not None else None,
        )


def _opt(cfg: Any, name: str, default: Any) -> Any:
    """An optional HF attribute: ``default`` when absent or None."""
    value = getattr(cfg, name, None)
    return default if value is None else value


def _cap(value: Any) -> float | None:
    return float(value) if value else None  # HF writes "no cap" as None or 0


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else ()


def _rope(text: Any, model_type: str) -> RopeConfig:
    """Old style (``rope_theta`` + ``rope_scaling``) or new (``rope_parameters``), new style first."""
    params = dict(_opt(text, "rope_parameters", {}))
    for key, value in dict(_opt(text, "rope_scaling", {})).items():
        params.setdefault(key, value)
    rope_type = params.get("rope_type", params.get("type", "default"))
    section = params.get("mrope_section")
    if model_type.startswith("qwen2_vl") and section is None:
        section = DEFAULT_MROPE_SECTION
    needed = _ROPE_SCALING_KEYS.get(rope_type, ())
    missing = [k for k in needed if params.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling: rope_type {rope_type!r} needs {', '.join(missing)}")
    scaling = {k: params[k] for k in needed}
    return RopeConfig(
        theta=float(params.get("rope_theta", _opt(text, "rope_theta", 10000.0))),
        rope_type="default" if rope_type == "mrope" else rope_type,  # M-RoPE is its sections, not a scaling
        mrope_section=tuple(int(s) for s in section) if section is not None else None,
        **scaling,
    )


def _sliding_windows(text: Any, model_type: str) -> tuple[int | None, ...]:
    """The window of each layer, from ``sliding_window`` and the layer pattern (``layer_types``, else
    ``max_window_layers``, else Gemma2's even/odd alternation, else every layer)."""
    n = int(text.num_hidden_layers)
    window = _opt(text, "sliding_window", None)
    layer_types = _opt(text, "layer_types", None)
    if layer_types is None and model_type == "gemma2":  # HF's default: even layers slide, odd ones do not
        layer_types = [SLIDING if i % 2 == 0 else FULL for i in range(n)]
    if layer_types is not None:
        if len(layer_types) != n:
            raise ValueError(f"layer_types: {len(layer_types)} entries for {n} layers")
        unknown = set(layer_types) - {SLIDING, FULL}
        if unknown:
            raise ValueError(f"layer_types: unsupported layer type(s) {sorted(unknown)}")
    if not window or _opt(text, "use_sliding_window", True) is False:
        return (None,) * n
    if layer_types is not None:
        return tuple(int(window) if t == SLIDING else None for t in layer_types)
    max_window_layers = _opt(text, "max_window_layers", n)
    return tuple(int(window) if i < max_window_layers else None for i in range(n))


def _vision(hf_config: Any) -> VisionConfig:
    v = hf_config.vision_config
    rope = _opt(v, "rope_parameters", {})
    return VisionConfig(
        depth=int(v.depth),
        embed_dim=int(v.embed_dim),
        num_heads=int(v.num_heads),
        mlp_ratio=float(v.mlp_ratio),
        hidden_act=str(v.hidden_act),
        in_channels=int(_opt(v, "in_channels", 3)),
        patch_size=int(v.patch_size),
        temporal_patch_size=int(v.temporal_patch_size),
        spatial_merge_size=int(v.spatial_merge_size),
        out_hidden_size=int(v.hidden_size),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        image_token_id=int(hf_config.image_token_id),
        vision_start_token_id=int(hf_config.vision_start_token_id),
        vision_end_token_id=int(hf_config.vision_end_token_id),
    )
