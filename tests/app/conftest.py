"""Fixtures of the app tests: a tiny random Llama with two adapters that answer differently, an engine
running on a background thread, and the app's controller over it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from app_fixtures import ADAPTERS, TinyApp, tiny_engine
from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint, make_qwen2_vl_checkpoint


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


@pytest.fixture
def bg(tiny_app: TinyApp) -> Iterator[Any]:
    from mmlora.engine.background import BackgroundEngine

    engine = BackgroundEngine(tiny_engine(tiny_app))
    try:
        yield engine
    finally:
        engine.shutdown(drain=False, timeout=10)


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2-VL checkpoint (no chat template) with its tokenizer and image processor."""
    folder = tmp_path_factory.mktemp("app_vl")
    return make_qwen2_vl_checkpoint(folder, vocab_size=320, vision_depth=1, max_pixels=16 * 28 * 28)
