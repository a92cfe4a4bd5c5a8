"""Serving smoke for ``dummy:<preset>`` models (random weights): random PEFT-format adapters written from the
model's own LoRA spec, then one mixed batch (adapters, base rows, images when the model takes them).

Used by the CUDA-only smoke tests of the Gemma2 and Qwen2-VL test files (bf16, real 9B / 7B shapes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

import mmlora


def write_random_adapter(spec: Any, folder: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter on every target of ``spec`` (a LoRAModelSpec), random A and B (std 1/sqrt(in), 0.01)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for target in spec.targets:
            for module, out_features in zip(target.slices, target.out_features):
                key = f"base_model.model.{spec.layers_prefix}.{layer}.{spec.module_parents[module]}.{module}"
                a = torch.randn(rank, target.in_features, generator=gen) / math.sqrt(target.in_features)
                b = torch.randn(out_features, rank, generator=gen) * 0.01
                tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(spec.module_names),
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def smoke_batch(
    preset: str,
    tmp: Path,
    images: list[Any] | None = None,
    lengths: tuple[int, ...] = (37, 300, 5, 120, 64, 900, 17, 250),
    max_new: int = 16,
    **engine_kwargs: Any,
) -> list[Any]:
    """Build ``dummy:<preset>`` with three random adapters; run one mixed batch of input_ids prompts.

    Every other request takes an image (cycling through ``images``) when images are given.
    """
    engine = mmlora.Engine(model=f"dummy:{preset}", **engine_kwargs)
    spec = engine.model.lora_model_spec()
    for i in range(3):
        engine.load_lora(f"a{i}", str(write_random_adapter(spec, tmp / f"a{i}", rank=8 * (i + 1), seed=i)))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (n,), generator=gen).tolist() for n in lengths]
    loras = [["a0", None, "a1", "a2"][i % 4] for i in range(len(prompts))]
    per_row = [None] * len(prompts)
    if images:
        per_row = [images[i % len(images)] if i % 2 == 0 else None for i in range(len(prompts))]
    outs = engine.generate(
        None,
        loras,
        per_row,
        {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True},
        input_ids=prompts,
        return_logprob=True,
    )
    for out in outs:
        assert len(out.output_ids) == max_new, out
        assert all(math.isfinite(lp) for lp in out.logprobs), out
    assert engine.kv_cache.allocator.usage == 0.0
    engine.close()  # free the 9B weights and the KV cache before the next test builds another engine
    return outs
