"""Fixtures of the server tests (helpers live in ``server_fixtures``): a tiny checkpoint with five PEFT
adapters (session), and a live server over it (per module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_fixtures import Served, TinyModel, build_tiny, serve, tiny_engine


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(tiny: TinyModel) -> Iterator[Served]:
    """A server over the tiny model with its five adapters, run-time updates on under the adapter root."""
    yield from serve(tiny_engine(tiny), enable_lora_runtime_update=True, lora_root=str(tiny.root))
