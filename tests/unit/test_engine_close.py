"""Engine.close frees what the engine holds even while it is still referenced, and a dropped engine is
freed at once: no reference cycle holds its KV cache until the garbage collector runs."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint

import mmlora
from mmlora.engine.cuda_graph import CudaGraphRunner

GREEDY = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("close")
    base = make_checkpoint(root / "base", "llama")
    adapter = make_adapter(base, root / "a0", seed=0, r=4, lora_alpha=8, target_modules=ALL_SEVEN)
    return base, adapter


@pytest.fixture
def no_gc() -> Iterator[None]:
    """The collector off: only reference counting may free anything during the test."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _engine(tiny) -> mmlora.Engine:
    base, adapter = tiny
    engine = mmlora.Engine(
        model=str(base), lora_paths={"a0": str(adapter)}, device="cpu", dtype="float32", max_kv_tokens=256
    )
    # The decode-graph runner on its eager path (no GPU here): it is what made the cycle on CUDA.
    engine.runner.decode_graphs = CudaGraphRunner(engine.runner, 4, engine.max_model_len, capture=False)
    engine.generate(["Hello world", "Paris is"], lora_paths=["a0", None], sampling_params=GREEDY)
    assert engine.runner.decode_graphs.num_replays > 0  # the graph path really ran
    return engine


def _storages(engine: mmlora.Engine) -> dict[str, weakref.ref]:
    """Weak references to the storages of the KV cache, one adapter slot buffer and one weight."""
    A = next(iter(engine.lora._pool.buffers.values()))[0]
    return {
        "kv cache": weakref.ref(engine.kv_cache.data.untyped_storage()),
        "adapter slots": weakref.ref(A.untyped_storage()),
        "weights": weakref.ref(engine.model.lm_head.weight.untyped_storage()),
    }


def test_close_frees_device_memory_while_the_engine_is_still_referenced(tiny, no_gc):
    engine = _engine(tiny)
    storages = _storages(engine)
    engine.close()
    assert [name for name, ref in storages.items() if ref() is not None] == []
    assert engine.runner.decode_graphs is None
    engine.close()  # a second close is a no-op
    with pytest.raises(RuntimeError, match="closed"):
        engine.add_request("Hello", sampling_params=GREEDY)
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()


def test_a_dropped_engine_is_freed_without_the_garbage_collector(tiny, no_gc):
    engine = _engine(tiny)
    storages = _storages(engine)
    alive = weakref.ref(engine)
    del engine
    assert alive() is None
    assert [name for name, ref in storages.items() if ref() is not None] == []


def test_context_manager_closes(tiny, no_gc):
    base, _ = tiny
    with mmlora.Engine(model=str(base), device="cpu", dtype="float32", max_kv_tokens=256) as engine:
        kv = weakref.ref(engine.kv_cache.data.untyped_storage())
        assert engine.generate("Hello", sampling_params=GREEDY)[0].output_ids
    assert kv() is None
