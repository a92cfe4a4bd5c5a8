"""CausalLM: what every model class shares: typed config, logits, LoRA model facts, weight loading,
dummy weights.

A model class declares its facts as data:
  hf_architectures        HF ``architectures`` names it serves (``hf_model_types`` when a config has none)
  packed_modules_mapping  our packed module -> the HF modules packed into it, in output order
  lora_module_parents     HF module name -> its parent inside a decoder layer
  lora_target_paths       our LoRA target -> its path inside a decoder layer
  lora_layers_prefix      HF path of the decoder layers
Packed linears carry ``output_sizes`` (one entry per packed HF module) set by the layer that builds them.

The HF config is read once, into ``self.arch`` (:class:`~mmlora.models.arch_config.ArchConfig`).
A multimodal class sets ``is_multimodal = True`` and gives ``encode_images(pixels, grid_thw)``; the
request work around it (prompt expansion, image processor, M-RoPE positions, the feature cache) is
:mod:`mmlora.multimodal`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from mmlora.forward.batch import ForwardBatch
from mmlora.layers.packed_linear import PackedLinear
from mmlora.layers.parallel_linear import full_weight_shape, shard_full_weight
from mmlora.lora.spec import LoRAModelSpec, LoRATarget
from mmlora.models.arch_config import ArchConfig


class CausalLM(nn.Module):
    hf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_model_types: ClassVar[tuple[str, ...]] = ()
    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {}
    lora_module_parents: ClassVar[dict[str, str]] = {}
    lora_target_paths: ClassVar[dict[str, str]] = {}
    lora_layers_prefix: ClassVar[str] = "model.layers"
    # HF prefixes of towers that take no LoRA, with the reason given to the user.
    lora_refused_prefixes: ClassVar[tuple[tuple[str, str], ...]] = ()
    # HF weight names that carry no parameter of ours (e.g. cached rotary tables).
    ignored_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    is_multimodal: ClassVar[bool] = False

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.arch = ArchConfig.from_hf(hf_config)

    @property
    def layers(self) -> nn.ModuleList:
        raise NotImplementedError

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, H] for every token of the batch."""
        raise NotImplementedError

    def make_lm_head(self, embed_tokens: nn.Embedding) -> nn.Linear:
        """The LM head: its own weight, or the token embedding's when the config ties them."""
        head = PackedLinear(self.arch.hidden_size, self.arch.vocab_size, bias=False)
        if self.arch.tie_word_embeddings:
            head.weight = embed_tokens.weight
        return head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> fp32 logits [B, V]."""
        logits = self.lm_head(hidden).float()
        cap = self.arch.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- LoRA facts -------------------------------------------------------------------------------

    def lora_model_spec(self, full: bool = True) -> LoRAModelSpec:
        """The targets at their full sizes (what adapters are validated against) or, with ``full=False``,
        at this tensor-parallel rank's shard sizes (what its adapter pool holds)."""
        layer = self.layers[0]
        targets = []
        for name, path in self.lora_target_paths.items():
            linear = layer.get_submodule(path)
            slices = self.packed_modules_mapping.get(name, (name,))
            sizes = tuple(getattr(linear, "output_sizes", (linear.out_features,)))
            in_features = linear.in_features
            if full:
                sizes = tuple(getattr(linear, "full_output_sizes", sizes))
                in_features = getattr(linear, "full_in_features", in_features)
            targets.append(LoRATarget(name, slices, in_features, sizes))
        return LoRAModelSpec(
            num_layers=len(self.layers),
            targets=tuple(targets),
            layers_prefix=self.lora_layers_prefix,
            module_parents=dict(self.lora_module_parents),
            refused_prefixes=self.lora_refused_prefixes,
        )

    # ---- weights ----------------------------------------------------------------------------------

    def _packed_lookup(self) -> dict[str, tuple[str, int]]:
        return {
            hf: (ours, i) for ours, hfs in self.packed_modules_mapping.items() for i, hf in enumerate(hfs)
        }

    def map_weight_name(self, name: str) -> tuple[str, int | None]:
        """HF parameter name -> (our parameter name, packed slice index or None)."""
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self._packed_lookup():
            ours, idx = self._packed_lookup()[parts[-2]]
            return ".".join([*parts[:-2], ours, parts[-1]]), idx
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (packed) parameters; every parameter must be written."""
        params = dict(self.named_parameters())
        tied = self.arch.tie_word_embeddings
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(self.ignored_weight_suffixes) or (tied and name == "lm_head.weight"):
                continue
            ours, idx = self.map_weight_name(name)
            param = params.get(ours)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            target = param.data
            module = self.get_submodule(ours.rsplit(".", 1)[0])
            tensor = shard_full_weight(module, tensor, idx)
            if idx is not None:
                sizes = module.output_sizes
                start = sum(sizes[:idx])
                target = target.narrow(0, start, sizes[idx])
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor.to(target.dtype))
            loaded.add(f"{ours}#{idx}")
        expected = set()
        for pname, _ in self.named_parameters():
            module_name = pname.rsplit(".", 1)[0]
            packed = self.packed_modules_mapping.get(module_name.rsplit(".", 1)[-1])
            expected.update(f"{pname}#{i}" for i in range(len(packed))) if packed else expected.add(
                f"{pname}#None"
            )
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(m.replace("#None", "") for m in missing[:8])
            raise ValueError(
                f"checkpoint is missing {len(missing)} tensor(s) of {type(self).__name__}: {shown}"
            )

    @torch.no_grad()
    def init_dummy_weights(self, seed: int) -> None:
        """Random weights for benchmarks: N(0, 0.02) matrices, zero biases, norms at their identity."""
        for i, module in enumerate(self.modules()):
            if isinstance(module, (nn.Linear, nn.Embedding)):
                # Drawn at the full shape and then sharded, so every tp_size gets the same model.
                w = module.weight
                shape = full_weight_shape(module) if isinstance(module, nn.Linear) else w.shape
                gen = torch.Generator(device=w.device).manual_seed(seed + i)
                full = torch.empty(shape, dtype=w.dtype, device=w.device).normal_(0.0, 0.02, generator=gen)
                w.copy_(shard_full_weight(module, full))
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
