"""Helpers of the server tests: the tiny Llama checkpoint and adapter specs (built with the shared
``tiny_models``), an engine over them, and a uvicorn server on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint

T = TypeVar("T")

ADAPTER_SPECS = {  # name -> (rank, alpha, targets, seed); different ranks and targets on purpose
    "a0": (4, 8, ALL_SEVEN, 1),
    "a1": (8, 16, ["q_proj", "v_proj"], 2),
    "a2": (2, 4, ["o_proj", "down_proj", "up_proj"], 3),
    "a3": (4, 4, ALL_SEVEN, 4),
    "a4": (8, 8, ["k_proj", "gate_proj"], 5),
}


def make_server_checkpoint(folder: Path) -> Path:
    """The server tests' Llama: default RoPE (theta 10000, no llama3 scaling), only the matrices redrawn."""
    return make_checkpoint(folder, "llama", rope_scaling=None, rope_theta=10000.0, perturb_vectors=False)


@dataclass
class TinyModel:
    folder: Path
    adapters: dict[str, Path]
    root: Path  # the folder holding the adapters (a --lora-root)


def build_tiny(root: Path) -> TinyModel:
    """The tiny checkpoint under ``root/base`` and the ``ADAPTER_SPECS`` adapters under ``root/loras``."""
    folder = root / "base"
    make_server_checkpoint(folder)
    lora_root = root / "loras"
    adapters = {}
    for name, (rank, alpha, targets, seed) in ADAPTER_SPECS.items():
        adapters[name] = lora_root / name
        make_adapter(folder, adapters[name], seed, r=rank, lora_alpha=alpha, target_modules=targets)
    return TinyModel(folder, adapters, lora_root)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving ``app`` on a thread, on a free loopback port."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@dataclass
class Served:
    url: str
    bg: Any
    engine: Any
    app: Any


def serve(engine: Any, **server_kwargs: Any) -> Iterator[Served]:
    from mmlora.engine.background import BackgroundEngine
    from mmlora.server.app import build_app
    from mmlora.server.config import ServerConfig

    bg = BackgroundEngine(engine)
    app = build_app(bg, ServerConfig(**server_kwargs))
    live = LiveServer(app)
    try:
        yield Served(live.url, bg, engine, app)
    finally:
        live.stop()
        bg.shutdown(drain=False, timeout=10)


def within(timeout: float, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` run on a daemon thread: its result or exception, or a test failure after ``timeout``
    seconds (for calls that block without a timeout of their own, such as iterating a RequestHandle)."""
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def tiny_engine(tiny: TinyModel, **kwargs: Any) -> Any:
    from mmlora import Engine

    opts = {
        "model": str(tiny.folder),
        "lora_paths": {name: str(p) for name, p in tiny.adapters.items()},
        "max_loras_per_batch": 4,
        "max_lora_rank": 8,
        "device": "cpu",
        "dtype": "float32",
        "served_model_name": "tiny",
        "max_kv_tokens": 8192,
    }
    opts.update(kwargs)
    return Engine(**opts)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny checkpoint with five PEFT adapters (a conftest imports this fixture to use it)."""
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(tiny: TinyModel) -> Iterator[Served]:
    """A server over the tiny model with its five adapters, run-time updates on under the adapter root."""
    yield from serve(tiny_engine(tiny), enable_lora_runtime_update=True, lora_root=str(tiny.root))
