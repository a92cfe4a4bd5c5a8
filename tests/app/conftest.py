"""Fixtures of the app tests: a tiny random Llama with two adapters that answer differently, an engine
running on a background thread, and the app's controller over it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint

ADAPTERS = {"alpha": 1, "beta": 2}  # name -> seed: different random weights, so different answers


@dataclass
class TinyApp:
    folder: Path
    root: Path  # the adapter root: holds alpha/, beta/ and a spare adapter gamma/
    adapters: dict[str, Path]


@pytest.fixture(scope="session")
def tiny_app(tmp_path_factory: pytest.TempPathFactory) -> TinyApp:
    base = tmp_path_factory.mktemp("app_tiny")
    folder = make_checkpoint(base / "model")
    root = base / "loras"
    adapters = {}
    for name, seed in {**ADAPTERS, "gamma": 3}.items():
        adapters[name] = make_adapter(
            folder, root / name, seed=seed, scale=0.3, r=4, lora_alpha=8, target_modules=ALL_SEVEN
        )
    return TinyApp(folder, root, adapters)


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


@pytest.fixture
def bg(tiny_app: TinyApp) -> Iterator[Any]:
    from mmlora.engine.background import BackgroundEngine

    engine = BackgroundEngine(tiny_engine(tiny_app))
    try:
        yield engine
    finally:
        engine.shutdown(drain=False, timeout=10)
