"""Test-wide setup: the shared helpers in tests/ are importable (``import tiny_models``), without a GPU
Triton kernels run in the interpreter (it must be set before any kernel is defined), and every engine a
test (or a module's fixtures) built is closed when that test (or module) ends: a tiny engine on a GPU
sizes its KV cache to the free memory, so one left alive starves the next."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# pytest-xdist workers share the CPU (scripts/test.sh: 2 on the 2-core CI machine). Each with torch's
# default of a thread per core oversubscribes it, and OpenMP threads waiting on each other then crawl: the
# quickstart notebook ran in 14 s alone and 160 s beside another worker. Each worker (and what it starts:
# notebook kernels, tensor-parallel workers, servers, through OMP_NUM_THREADS) gets its share of the cores.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _share = max(1, (os.cpu_count() or 1) // _workers)
    if torch.get_num_threads() > _share:
        torch.set_num_threads(_share)
        os.environ["OMP_NUM_THREADS"] = str(_share)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        import triton_specs  # scripts/cuda_compile_check.py records this run's launches through it

        triton_specs.install_from_env()

_built: list[weakref.ref] = []  # every Engine built in this session, in order

# On CUDA an engine without max_kv_tokens sizes its KV cache to mem_fraction_static of the whole card,
# less what is in use there; benchmarks/gpu_tests.sh runs several pytest processes on one card, so such an
# engine would leave the others' engines no room. Tests cap it here. The fraction itself is of the whole
# card, which those processes share: with 67 GiB of 79 in use by the others, 0.85 leaves nothing even for
# an engine capped at 2048 tokens (all 20 failures of part 1 in
# benchmarks/results/h100-2026-12-06-session40/t1). Capped test engines plan against all the card's free
# memory instead; the cap bounds what each takes.
TEST_KV_TOKENS_ON_CUDA = 1 << 16


def _cap_kv_cache_on_cuda() -> None:
    """Wrap the KV planner once: on CUDA, an engine whose config sets no cap gets TEST_KV_TOKENS_ON_CUDA,
    and the plan may use the whole card's free memory (mem_fraction_static 1)."""
    from mmlora.engine import setup

    plan = setup._plan_kv_blocks
    if getattr(plan, "capped", False):
        return

    @functools.wraps(plan)
    def capped_plan(config: Any, device: torch.device, *args: Any) -> int:
        if device.type != "cuda":
            return plan(config, device, *args)
        cap = config.cache.max_kv_tokens
        if cap is None:
            cap = TEST_KV_TOKENS_ON_CUDA
        cache = dataclasses.replace(config.cache, mem_fraction_static=1.0, max_kv_tokens=cap)
        return plan(dataclasses.replace(config, cache=cache), device, *args)

    capped_plan.capped = True  # type: ignore[attr-defined]
    setup._plan_kv_blocks = capped_plan


def _track_engines() -> None:
    """Wrap ``Engine.__init__`` once so each engine built is noted (weakly: noting keeps none alive)."""
    from mmlora.engine.engine import Engine

    _cap_kv_cache_on_cuda()
    init = Engine.__init__
    if getattr(init, "tracked", False):
        return

    @functools.wraps(init)
    def tracked_init(self: Engine, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _built.append(weakref.ref(self))

    tracked_init.tracked = True  # type: ignore[attr-defined]
    Engine.__init__ = tracked_init  # type: ignore[method-assign]


def _close_built_since(mark: int) -> None:
    refs = _built[mark:]
    del _built[mark:]
    for ref in refs:
        engine = ref()
        if engine is not None:
            engine.close()


@pytest.fixture(autouse=True, scope="module")
def _close_module_engines() -> Iterator[None]:
    """Engines of module-scoped fixtures: autouse, so set up before them and torn down after them."""
    _track_engines()
    mark = len(_built)
    yield
    _close_built_since(mark)


@pytest.fixture(autouse=True)
def _close_test_engines() -> Iterator[None]:
    """Engines a test built, and those ``mmlora.generate`` cached for reuse, closed after the test (and
    after its own fixtures, which may still stop a background thread that steps one)."""
    mark = len(_built)
    yield
    import mmlora

    mmlora.shutdown()
    _close_built_since(mark)
    if torch.cuda.is_available():
        # What the test's own tensors and reference models left in this process's caching allocator is
        # invisible free memory to the other pytest processes on the card (benchmarks/gpu_tests.sh).
        torch.cuda.empty_cache()
