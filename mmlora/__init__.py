"""mmlora: serve many LoRA adapters on one base model, in one continuous batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmlora.engine.engine import Engine
from mmlora.engine.sampling_params import RequestOutput, SamplingParams
from mmlora.hub import parse_hub_ref

__all__ = ["Engine", "RequestOutput", "SamplingParams", "generate"]


def generate(
    images: Sequence[Any] | None,
    texts: str | Sequence[str],
    lora_paths: str | Sequence[str | None] | None = None,
    *,
    model: str = "smollm2",
    sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
    return_logprob: bool = False,
    **engine_kwargs: Any,
) -> list[RequestOutput]:
    """Build an engine for ``model`` and run every text to completion, one output per text.

    ``lora_paths[i]`` is None (the base model), an adapter folder (loaded on first use) or a Hugging Face
    Hub id ``org/name[@revision]`` (resolved into the hub cache when the engine starts); one value applies
    to every text.
    ``images[i]`` is None or an image (or list of images) for a vision-language model.
    """
    per_text = [lora_paths] if isinstance(lora_paths, str) else list(lora_paths or [])
    hub_ids = sorted({p for p in per_text if p is not None and parse_hub_ref(p) is not None})
    engine = Engine(model=model, lora_paths=hub_ids, **engine_kwargs)
    return engine.generate(texts, lora_paths, images, sampling_params, return_logprob=return_logprob)
