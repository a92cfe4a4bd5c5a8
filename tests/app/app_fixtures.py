"""Shared by the app tests (imported by name, not through conftest, which other test folders also have)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADAPTERS = {"alpha": 1, "beta": 2}  # name -> seed: different random weights, so different answers


@dataclass
class TinyApp:
    folder: Path
    root: Path  # the adapter root: holds alpha/, beta/ and a spare adapter gamma/
    adapters: dict[str, Path]


def tiny_engine(tiny: TinyApp, **kwargs: Any) -> Any:
    from mmlora import Engine

    opts: dict[str, Any] = {
        "model": str(tiny.folder),
        "lora_paths": {name: str(tiny.adapters[name]) for name in ADAPTERS},
        "max_loras_per_batch": 3,
        "max_lora_rank": 8,
        "device": "cpu",
        "dtype": "float32",
        "served_model_name": "tiny",
        "max_kv_tokens": 4096,
    }
    opts.update(kwargs)
    return Engine(**opts)
