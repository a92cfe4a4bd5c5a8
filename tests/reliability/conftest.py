"""Fixtures of the reliability suite: the server tests' tiny model and adapters, and a live server over
them with run-time adapter updates on (helpers from ``tests/server/server_fixtures.py``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "server"))

from server_fixtures import Served, TinyModel, build_tiny, serve, tiny_engine  # noqa: E402


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(tiny: TinyModel) -> Iterator[Served]:
    yield from serve(tiny_engine(tiny), enable_lora_runtime_update=True, lora_root=str(tiny.root))
