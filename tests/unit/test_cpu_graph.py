"""CPU decode plans in the engine (mmlora.engine.cpu_graph): decode steps replayed from recorded C kernel
calls give the tokens and logprobs of eager steps exactly, with adapters mixed, when the adapter pool
changes between steps (plans dropped and made again), and where a capture is refused."""

from __future__ import annotations

import logging

import pytest
from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint

import mmlora
from mmlora.backends import cpu_kernels, cpu_plan
from mmlora.engine.cpu_graph import CpuGraphRunner

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels are not built here")

PROMPTS = ["Hello world", "Paris is", "The cat sat on", "One two three four", "a b", "Hi"]
GREEDY = {"max_new_tokens": 9, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_graph")
    base = make_checkpoint(root / "base", "llama")
    adapters = {
        f"a{i}": make_adapter(base, root / f"a{i}", seed=i, r=4 - i, lora_alpha=8, target_modules=ALL_SEVEN)
        for i in range(3)
    }
    return base, adapters


def _engine(tiny, plans: bool, names: list[str], dtype: str = "float32") -> mmlora.Engine:
    base, adapters = tiny
    return mmlora.Engine(
        model=str(base), lora_paths={n: str(adapters[n]) for n in names}, device="cpu", dtype=dtype,
        max_loras_per_batch=3, max_lora_rank=4, max_kv_tokens=512, disable_cpu_graph=not plans,
    )  # fmt: skip


def _run(engine: mmlora.Engine, loras: list[str | None]) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(PROMPTS, lora_paths=loras, sampling_params=GREEDY, return_logprob=True)
    return [(o.output_ids, o.logprobs) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_decode_steps_equal_eager_ones(tiny, dtype):
    loras = ["a0", None, "a1", "a0", "a2", None]
    eager = _engine(tiny, False, ["a0", "a1", "a2"], dtype)
    assert eager.runner.decode_graphs is None
    expected = _run(eager, loras)
    engine = _engine(tiny, True, ["a0", "a1", "a2"], dtype)
    graphs = engine.runner.decode_graphs
    assert isinstance(graphs, CpuGraphRunner)
    assert _run(engine, loras) == expected  # tokens and logprobs, exactly
    assert graphs.num_captures >= 1 and graphs.num_plan_replays >= 5  # the plans really ran
    # a second batch on the same plans
    assert _run(engine, loras[::-1]) == _run(eager, loras[::-1])


def test_a_pool_write_drops_the_plans(tiny):
    engines = [_engine(tiny, plans, ["a0"]) for plans in (False, True)]
    graphs = engines[1].runner.decode_graphs
    results = []
    for engine in engines:
        first = _run(engine, ["a0", None] * 3)
        engine.load_lora("a1", str(tiny[1]["a1"]))  # a new adapter: its slot is written
        engine.load_lora("a2", str(tiny[1]["a2"]))
        second = _run(engine, ["a1", "a2", None, "a1", "a0", "a2"])
        engine.unload_lora("a1")
        third = _run(engine, ["a2", "a0", None, None, "a0", "a2"])
        results.append((first, second, third))
    assert results[1] == results[0]
    assert graphs.num_captures >= 3  # made again after each change of the pool
    assert len(graphs.plans) <= graphs.max_plans


def test_a_refused_capture_runs_eagerly(tiny, monkeypatch, caplog):
    loras = ["a0", None, "a0", None, "a0", None]
    expected = _run(_engine(tiny, False, ["a0"]), loras)
    engine = _engine(tiny, True, ["a0"])
    monkeypatch.setattr(cpu_plan, "capture", lambda forward: (forward(), None, "a test refuses it"))
    with caplog.at_level(logging.WARNING, logger="mmlora.engine.cpu_graph"):
        assert _run(engine, loras) == expected
        engine.generate(PROMPTS[:3], lora_paths=loras[:3], sampling_params=GREEDY)  # another batch size
    assert caplog.text.count("a test refuses it") == 1  # once, though two batch sizes were refused
    assert len(engine.runner.decode_graphs._refused) == 2
    assert engine.runner.decode_graphs.num_plan_replays == 0
