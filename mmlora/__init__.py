"""mmlora: serve many LoRA adapters on one base model, in one continuous batch."""

from __future__ import annotations

import atexit
import importlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmlora.engine.engine import Engine
    from mmlora.engine.sampling_params import RequestOutput, SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams", "generate", "shutdown"]

# `import mmlora` stays light (no torch, transformers or triton): the public classes are imported on
# first use, through the module-level __getattr__ of PEP 562, from this table only.
_LAZY = {
    "Engine": "mmlora.engine.engine",
    "RequestOutput": "mmlora.engine.sampling_params",
    "SamplingParams": "mmlora.engine.sampling_params",
}

# Engines built by generate(), keyed by model and options; the oldest is dropped beyond the limit.
MAX_CACHED_ENGINES = 2
_engines: OrderedDict[str, Engine] = OrderedDict()
_engines_lock = threading.Lock()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mmlora' has no attribute {name!r}")


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
    """Run every text to completion on ``model``, one output per text.

    ``lora_paths[i]`` is None (the base model), an adapter folder (loaded on first use) or a Hugging Face
    Hub id ``org/name[@revision]`` (resolved into the hub cache when the engine starts); one value applies
    to every text.
    ``images[i]`` is None or an image (or list of images) for a vision-language model.

    The engine is built on the first call and reused by later calls with the same ``model`` and
    ``engine_kwargs`` (a changed option builds a new one; the last ``MAX_CACHED_ENGINES`` are kept).
    ``mmlora.shutdown()`` releases them, as does the end of the process.
    """
    from mmlora.config import EngineConfig
    from mmlora.hub import parse_hub_ref
    from mmlora.preflight import check_engine_config

    per_text = [lora_paths] if isinstance(lora_paths, str) else list(lora_paths or [])
    hub_ids = sorted({p for p in per_text if p is not None and parse_hub_ref(p) is not None})
    config = EngineConfig.from_kwargs(model=model, lora_paths=hub_ids, **engine_kwargs)
    check_engine_config(config, images=images)
    engine = _cached_engine(config)
    return engine.generate(texts, lora_paths, images, sampling_params, return_logprob=return_logprob)


def _cached_engine(config: Any) -> Engine:
    from mmlora.engine.engine import Engine

    key = repr(config)  # the frozen config holds lists, so its repr is the key
    with _engines_lock:
        engine = _engines.get(key)
        if engine is not None:
            _engines.move_to_end(key)
            return engine
        engine = Engine(config=config)
        _engines[key] = engine
        while len(_engines) > MAX_CACHED_ENGINES:
            _engines.popitem(last=False)
        return engine


def shutdown() -> None:
    """Release the engines that ``generate`` keeps for reuse (their weights, KV cache and adapters)."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for engine in engines:
        engine.close()


atexit.register(shutdown)
