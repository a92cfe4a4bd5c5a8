"""Fixtures of the server tests (helpers live in ``server_fixtures``): a tiny checkpoint with five PEFT
adapters (session), and a live server over it (per module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_fixtures import ADAPTER_SPECS, Served, TinyModel, make_server_checkpoint, serve, tiny_engine
from tiny_models import make_adapter


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    root = tmp_path_factory.mktemp("tiny")
    folder = root / "base"
    make_server_checkpoint(folder)
    lora_root = root / "loras"
    adapters = {}
    for name, (rank, alpha, targets, seed) in ADAPTER_SPECS.items():
        adapters[name] = lora_root / name
        make_adapter(folder, adapters[name], seed, r=rank, lora_alpha=alpha, target_modules=targets)
    return TinyModel(folder, adapters, lora_root)


@pytest.fixture(scope="module")
def server(tiny: TinyModel) -> Iterator[Served]:
    """A server over the tiny model with its five adapters, run-time updates on under the adapter root."""
    yield from serve(tiny_engine(tiny), enable_lora_runtime_update=True, lora_root=str(tiny.root))
