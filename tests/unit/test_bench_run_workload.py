"""The serving benchmark's driver: each timed run is independent of the runs before it, and its step
timers count the steps they say they do."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint

import mmlora
from mmlora.bench import serving_parts
from mmlora.bench.serving_parts import StepRecorder, mean_step_seconds, run_workload, weight_bytes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    base = make_checkpoint(root / "base", "llama")
    adapter = make_adapter(base, root / "a0", seed=0, r=4, lora_alpha=8, target_modules=ALL_SEVEN)
    return mmlora.Engine(model=str(base), lora_paths={"a0": str(adapter)}, device="cpu", dtype="float32")


def test_a_repeated_run_recomputes_every_prompt_token(tiny):
    """Runs repeat prompts (rounds of a sweep, the same request at every adapter count): a prefix cache
    left warm by one run would skip the next run's prefill, so its TTFT and throughput would measure
    the cache. The oracle is the workload's own prompt-token count."""
    eng = tiny
    assert eng.scheduler.prefix_cache.enabled
    prompts = [list(range(3 + i, 40 + i)) for i in range(4)]
    work = [
        {"arrival": 0.0, "input_ids": ids, "output_len": 3, "lora": lora}
        for ids in prompts
        for lora in ("a0", None)
    ]
    recorder = StepRecorder(eng, weight_bytes(eng.model), torch.float32)
    prompt_tokens = sum(len(w["input_ids"]) for w in work)
    for _ in range(2):
        before = eng.stats()["prefill_tokens_computed_total"]
        run_workload(eng, [dict(w) for w in work], recorder, 1e9)
        assert eng.stats()["prefill_tokens_computed_total"] - before == prompt_tokens


class _ClockedEngine:
    """Stands in for an engine: each step advances a fake clock by the next of ``costs``."""

    device = torch.device("cpu")

    def __init__(self, clock: SimpleNamespace, costs: list[float]) -> None:
        self.clock, self.costs = clock, costs

    def step(self) -> None:
        self.clock.now += self.costs.pop(0)


def test_undrained_step_mean_times_only_the_steps_after_warm_up(monkeypatch):
    """The warm steps (here the slow ones: a pipeline filling) stay out of the mean, which is over exactly
    ``steps`` steps. Oracle: the costs the fake clock was given."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(serving_parts, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    engine = _ClockedEngine(clock, [9.0, 9.0, 2.0, 3.0, 4.0, 100.0])
    assert mean_step_seconds(engine, 3, warm=2, drain=False) == pytest.approx(3.0)
    assert engine.costs == [100.0]  # no step beyond warm + steps
