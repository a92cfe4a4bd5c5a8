"""The staged shrink (``lora_stage_slots``, :mod:`mmlora.lora.stage`) in an engine: the decode graph
runner's staged layouts against the ordinary eager engine (no stage), uncaptured on any device and captured
on CUDA; when a step takes the stage (``mmlora.forward.stage_policy``); what start-up says of its memory and
where it is left off. The kernels and the stage's bookkeeping: ``test_lora_stage.py``.
"""

from __future__ import annotations

import gc
import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from graph_safety import KeyLog, assert_same_outputs  # noqa: E402
from test_cuda_graph import PROMPTS, _engine  # noqa: E402  (the tiny engine of the decode graph tests)

import mmlora  # noqa: E402
from mmlora.engine.cuda_graph import CudaGraphRunner  # noqa: E402
from mmlora.forward import stage_policy  # noqa: E402
from mmlora.forward.lora import STAGED_LAYOUTS  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _stage_every_batch_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both of ``stage_policy``'s bounds at 0: these tests' batches put one row on an adapter (which the
    default ``min_rows_per_adapter`` of 1.5 sends to the backend's layout), and they check the staged arithmetic;
    the test of the policy sets its bounds itself."""
    monkeypatch.setitem(stage_policy.SETTINGS, "min_fill", 0.0)
    monkeypatch.setitem(stage_policy.SETTINGS, "min_rows_per_adapter", 0.0)


LORAS = ["a", "a", None, "a", "b", "b"]
# Six tokens: every decode layout these tests expect is replayed within them (ten took 148 s of the CI's
# CPU for the four engine tests, six 81 s).
SAMPLING = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _generate(engine: mmlora.Engine) -> list:
    return engine.generate(input_ids=PROMPTS, lora_paths=LORAS, sampling_params=SAMPLING, return_logprob=True)


# (pool options, stage positions): an unpaged pool, and one paged by two ranks where adapter "a" (rank 4)
# takes two positions and "b" (rank 2) one.
POOLS = [({}, 2), ({"lora_page_rank": 2}, 3)]


# (backend, pool, dtype): each backend, pool and dtype once (an engine pair costs about 25 s on the CI's CPU;
# triton-auto's staged expand is SGMV's). bf16 on CPU only: on CUDA the wider GEMM's cuBLAS algorithm may
# round the base columns differently (see test_captured_staged_graphs_equal_eager).
RUNNER_CASES = [
    ("triton-sgmv", *POOLS[0], "float32"),
    ("triton-auto", *POOLS[1], "float32"),
    *([] if torch.cuda.is_available() else [("triton-auto", *POOLS[0], "bfloat16")]),
]


@pytest.mark.parametrize(
    "backend,pool,positions,dtype",
    RUNNER_CASES,
    ids=[f"{b}-{'paged' if p else 'unpaged'}-{d}" for b, p, _, d in RUNNER_CASES],
)
def test_graph_runner_in_the_staged_layout_matches_eager(
    tiny, backend: str, pool: dict, positions: int, dtype: str
) -> None:
    """The decode graph runner's static-buffer path (uncaptured, so on any device) with just enough stage
    positions for both adapters: decode steps replay the staged layouts and give the tokens and logprobs
    of the eager engine without a stage. A batch of adapter "a" alone, at the first of the unpaged stage's
    two positions (where the stage places it: the narrowest layout's), replays ``staged/2``, whose GEMM
    reads that position only."""
    base, adapters = tiny()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(lora_backend=backend, disable_cuda_graph=True, dtype=dtype, **pool)
    only_a = dict(
        input_ids=PROMPTS[:3], lora_paths=["a", None, "a"], sampling_params=SAMPLING, return_logprob=True
    )
    eager = _engine(base, adapters, device, **kw)
    ref, ref_a = _generate(eager), eager.generate(**only_a)
    engine = _engine(base, adapters, device, lora_stage_slots=positions, **kw)
    assert (engine.runner.lora.page_rank is not None) == bool(pool)
    stage = engine.runner.lora.stage
    assert stage.layouts == ("staged/2", "staged")  # 2 or 3 positions: widths 1 and all
    assert set(stage.layouts) <= set(engine.runner.lora.graph_layouts)
    graphs = engine.runner.decode_graphs = CudaGraphRunner(
        engine.runner, 5, engine.max_model_len, capture=False
    )
    graphs.graphs = KeyLog(graphs.graphs)
    # bf16: the same tokens; logprobs within 0.05 (0.038 seen on CPU, where the wider GEMM's base columns are
    # bit-equal to x @ W.T: h is the GEMM's sums rounded to bf16, not the shrink kernel's, in another order)
    atol = 1e-4 if dtype == "float32" else 5e-2
    assert_same_outputs(ref, _generate(engine), atol)
    used = {layout for _, bound, layout in graphs.graphs.used if bound}
    # Both adapters: every position; a step of one adapter (requests start and end in turn) may take less.
    assert "staged" in used and used <= {"staged", "staged/2"}, used
    graphs.graphs.used.clear()
    assert_same_outputs(ref_a, engine.generate(**only_a), atol)
    used = {layout for _, bound, layout in graphs.graphs.used if bound}
    # Unpaged, "a" holds position 0 of 2; paged by 2 ranks, "a" (rank 4) holds positions 0-1 of 3, more
    # than staged/2's one.
    assert used == ({"staged"} if pool else {"staged/2"}), used


def test_a_batch_that_fills_too_little_or_has_too_few_rows_replays_the_usual_layout(
    tiny, monkeypatch
) -> None:  # noqa: ANN001
    """``stage_policy.SETTINGS``: a decode batch whose adapters take less than ``min_fill`` of the narrowest
    staged layout that holds them, or have fewer than ``min_rows_per_adapter`` rows each on average (base
    rows not counted), replays the backend's own layout; with both 0 every batch that fits is staged."""
    base, adapters = tiny()
    engine = _engine(
        base, adapters, "cpu", lora_backend="triton-sgmv", lora_stage_slots=4, lora_page_rank=2,
        disable_cuda_graph=True,
    )  # fmt: skip
    engine.generate(input_ids=PROMPTS[:2], lora_paths=["a", "b"], sampling_params={"max_new_tokens": 1})
    lora = engine.runner.lora
    a, b = (lora.slot_of(lora.entry(name)) for name in "ab")
    # Paged by 2 ranks: "a" (rank 4) takes two positions, "b" (rank 2) one; of 4, layouts read 1, 2 or 4.
    assert lora.stage.layouts == ("staged/4", "staged/2", "staged")
    both = [a, b, -1, a]
    assert lora.prepare_replay(both)[1] == "staged"  # 3 of its 4 positions
    monkeypatch.setitem(stage_policy.SETTINGS, "min_fill", 0.8)
    assert lora.prepare_replay(both)[1] not in STAGED_LAYOUTS  # 3 of 4 is less than 0.8
    assert lora.prepare_replay([b, b])[1] == "staged/4"  # 1 of 1
    assert lora.prepare_replay([a, -1])[1] == "staged/2"  # 2 of 2
    assert not lora.stage.worth(both) and lora.stage.worth([a])
    monkeypatch.setitem(stage_policy.SETTINGS, "min_fill", 0.0)
    monkeypatch.setitem(stage_policy.SETTINGS, "min_rows_per_adapter", 1.5)
    assert lora.prepare_replay(both)[1] == "staged"  # 3 rows on 2 adapters: 1.5 each
    assert lora.prepare_replay([a, b, -1, -1])[1] not in STAGED_LAYOUTS  # 1 each
    assert lora.prepare_replay([b, b, -1])[1] == "staged/4"  # 2 on 1
    assert lora.prepare_replay([a, -1])[1] not in STAGED_LAYOUTS  # 1 on 1
    assert [lora.stage.worth(s) for s in ([a, a, b, b], [a, b, a], [a, b, -1, -1])] == [True, True, False]
    engine.shutdown()


@pytest.mark.parametrize("kv_tokens", [64, 4096])
def test_a_stage_that_crowds_the_kv_cache_is_warned_of(tiny, caplog, kv_tokens: int) -> None:  # noqa: ANN001
    """The stage's memory comes out of the KV cache: past a tenth of the cache's bytes, start-up warns with
    both sizes."""
    base, adapters = tiny()
    with caplog.at_level("WARNING", logger="mmlora.engine.setup"):
        engine = _engine(
            base, adapters, "cpu", lora_backend="triton-sgmv", lora_stage_slots=2, max_kv_tokens=kv_tokens
        )
    stage, alloc = engine.runner.lora.stage, engine.kv_cache.allocator
    assert stage is not None and stage.nbytes() > 0
    assert engine.stats()["lora_stage_positions"] == 2
    attn = engine.model.layers[0].self_attn
    # K and V of every layer, fp32: the KV cache's bytes from the model's shapes.
    kv_bytes = (
        alloc.num_blocks
        * alloc.block_size
        * len(engine.model.layers)
        * 2
        * attn.num_kv_heads
        * attn.head_dim
        * 4
    )
    warned = [r.getMessage() for r in caplog.records if "shrink stage takes" in r.getMessage()]
    assert len(warned) == (stage.nbytes() > 0.1 * kv_bytes), (stage.nbytes(), kv_bytes, warned)
    if warned:
        assert f"{100 * stage.nbytes() / kv_bytes:.0f}% of the KV cache" in warned[0]
    engine.shutdown()


@pytest.mark.parametrize(
    ("kw", "why"), [(dict(lora_backend="torch-gather"), "the torch-gather backend has no staged expand")]
)
def test_the_stage_is_left_off_where_it_cannot_serve(tiny, caplog, kw: dict, why: str) -> None:  # noqa: ANN001
    """A backend without a staged expand: no ``staged`` graphs, and a warning says why."""
    base, adapters = tiny()
    with caplog.at_level("WARNING", logger="mmlora.lora.manager"):
        engine = _engine(base, adapters, "cpu", lora_stage_slots=2, **kw)
    assert "staged" not in engine.runner.lora.graph_layouts
    assert engine.runner.lora.stage is None
    assert f"lora_stage_slots=2 is unused: {why}" in caplog.text


@cuda
@pytest.mark.parametrize("pool,positions", POOLS, ids=["unpaged", "paged"])
def test_captured_staged_graphs_equal_eager(tiny, pool: dict, positions: int) -> None:
    """Captured decode graphs with the stage: the eager engine's tokens and logprobs, in fp32. (In bf16 the
    tiny model's greedy tokens parted after four steps on an H100, session 36. On CPU the same bf16 engine
    with the stage gives eager's tokens (the runner test above), so the likely cause is cuBLAS: the wider
    ``[W; A]`` GEMM may take another algorithm, and its base columns round differently from ``x @ W.T``'s.
    The staged expand's bf16 results are checked against the fp64 oracle above.)"""
    base, adapters = tiny()
    ref = _generate(_engine(base, adapters, "cuda", disable_cuda_graph=True, **pool))
    got, used = _generate_captured(_engine(base, adapters, "cuda", lora_stage_slots=positions, **pool))
    assert_same_outputs(ref, got, 1e-4)
    assert "staged" in used, used


def _generate_captured(engine: mmlora.Engine) -> tuple[list, set[str]]:
    """(:func:`_generate`'s outputs, the LoRA layouts of the captured graphs replayed); the engine closed."""
    graphs = engine.runner.decode_graphs
    graphs.graphs = KeyLog(graphs.graphs)
    got = _generate(engine)
    used = {layout for _, bound, layout in graphs.graphs.used if bound}
    engine.close()
    gc.collect()
    torch.cuda.empty_cache()
    return got, used


def test_staged_graphs_with_a_segment_per_row_take_every_batch_that_fits(tiny, monkeypatch) -> None:  # noqa: ANN001
    """triton-auto's ``staged_segments="rows"`` (the default): the ``staged`` graphs have a segment entry per
    row, so a step with more runs than half its rows (each request on its own adapter, as at B=32 on 24
    adapters) replays them too, with the eager engine's tokens; with "half" it replays BGMV's rows."""
    from mmlora.backends import triton_auto

    base, adapters = tiny()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loras = ["a", "b", None, "a", "b", None]  # sorted by slot: runs of one or two rows
    prompts = PROMPTS[:6]

    def generate(engine: mmlora.Engine) -> list:
        return engine.generate(
            input_ids=prompts, lora_paths=loras, sampling_params=SAMPLING, return_logprob=True
        )

    kw = dict(lora_backend="triton-auto", disable_cuda_graph=True)
    ref = generate(_engine(base, adapters, device, **kw))
    used = {}
    for setting in ("half", "rows"):
        monkeypatch.setitem(triton_auto.TUNING, "staged_segments", setting)
        engine = _engine(base, adapters, device, lora_stage_slots=2, max_running_requests=3, **kw)
        graphs = engine.runner.decode_graphs = CudaGraphRunner(
            engine.runner, 3, engine.max_model_len, capture=False
        )
        graphs.graphs = KeyLog(graphs.graphs)
        assert_same_outputs(ref, generate(engine), 1e-4)
        used[setting] = {layout for _, bound, layout in graphs.graphs.used if bound}
    assert "rows" in used["half"], used
    assert used["rows"] == {"staged"}, used


@pytest.mark.parametrize(
    ("budget", "cap", "nbytes", "fits"),
    [
        (1000, None, 50, True),  # 5% of the KV cache's memory
        (1000, None, 51, False),
        (1000, 10, 900, True),  # the capped cache (10 tokens of 10 bytes) leaves 900 unused
        (1000, 10, 901, False),
        (1000, 200, 60, False),  # the capped cache takes more than the budget: the share rule alone
    ],
)
def test_auto_stages_what_fits_beside_the_kv_cache(monkeypatch, budget, cap, nbytes, fits) -> None:  # noqa: ANN001
    """``lora_stage_slots`` None (auto): a stage of at most ``STAGE_AUTO_KV_SHARE`` of the KV cache's
    memory, or of what a ``max_kv_tokens`` cap leaves unused; never off CUDA, nor without decode graphs."""
    from mmlora.config import EngineConfig
    from mmlora.engine import setup

    monkeypatch.setattr(setup, "_kv_budget_bytes", lambda *a: budget)
    assert setup.STAGE_AUTO_KV_SHARE == 0.05
    config = EngineConfig.from_kwargs(model="dummy:tiny", max_kv_tokens=cap)
    per_token = 10
    assert setup._stage_fits(config, torch.device("cuda"), per_token, 64, 100, nbytes) is fits
    assert setup._stage_fits(config, torch.device("cpu"), per_token, 64, 100, nbytes) is False
    eager = EngineConfig.from_kwargs(model="dummy:tiny", max_kv_tokens=cap, disable_cuda_graph=True)
    assert setup._stage_fits(eager, torch.device("cuda"), per_token, 64, 100, nbytes) is False


def test_auto_builds_the_stage_it_was_asked_about(tiny, monkeypatch) -> None:  # noqa: ANN001
    """Auto asks start-up whether the stage's bytes fit and builds exactly that stage: ``min(32, pool
    pages)`` positions whose :meth:`ShrinkStage.nbytes` are the bytes asked about; when they do not fit,
    or the backend has no staged expand (not asked, no warning), there is none. The default on CPU: none."""
    from mmlora.engine import setup

    base, adapters = tiny()
    default = _engine(base, adapters, "cpu", lora_backend="triton-sgmv")
    assert default.runner.lora.stage is None and default.stats()["lora_stage_positions"] == 0
    asked = []

    def fits(answer: bool):  # noqa: ANN202
        def stage_fits(*args) -> bool:  # noqa: ANN002
            asked.append(args[-1])
            return answer

        return stage_fits

    monkeypatch.setattr(setup, "_stage_fits", fits(True))
    engine = _engine(base, adapters, "cpu", lora_backend="triton-sgmv", disable_cuda_graph=True)
    stage = engine.runner.lora.stage
    assert stage is not None and stage.capacity == 2  # the pool's two slots
    assert asked == [stage.nbytes()] and stage.nbytes() > 0
    assert "staged" in engine.runner.lora.graph_layouts
    engine.shutdown()
    monkeypatch.setattr(setup, "_stage_fits", fits(False))
    assert _engine(base, adapters, "cpu", lora_backend="triton-sgmv").runner.lora.stage is None
    assert len(asked) == 2
    engine = _engine(base, adapters, "cpu", lora_backend="torch-gather")
    assert engine.runner.lora.stage is None and len(asked) == 2


@cuda
def test_the_default_engine_on_cuda_stages_beside_a_capped_kv_cache(tiny) -> None:  # noqa: ANN001
    """The default (auto) on CUDA: the tiny engine's KV cache is capped at 2048 tokens, so a stage of its
    pool's two slots fits in what the cap leaves, and its captured graphs give the tokens of an engine
    without one (fp32)."""
    base, adapters = tiny()
    ref = _generate(_engine(base, adapters, "cuda", lora_stage_slots=0))
    engine = _engine(base, adapters, "cuda")
    stage = engine.runner.lora.stage
    assert stage is not None and stage.capacity == 2
    got, used = _generate_captured(engine)
    assert_same_outputs(ref, got, 1e-4)
    assert "staged" in used, used
