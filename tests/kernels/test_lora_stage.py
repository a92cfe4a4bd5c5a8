"""The staged shrink (``lora_stage_slots``, :mod:`mmlora.lora.stage`): the base GEMM over ``[W; A_stage]``
gives the base output and every staged adapter's shrink, and the expand reads each row's own columns.

Oracles: the fp64 per-token loop of ``lora_cases.py`` for the staged expand; plain matmuls for the stage's
GEMM and its bookkeeping; the ordinary eager engine (no stage) for the decode graph runner's ``staged``
layout (uncaptured on any device, captured on CUDA).
"""

from __future__ import annotations

import gc
import os
import random

import torch

if not torch.cuda.is_available():  # must precede the first triton import of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from graph_safety import KeyLog, assert_same_outputs  # noqa: E402
from lora_cases import CPU_CASES, DEV, assert_out, make_case, reference, route_as_graph_runs  # noqa: E402
from test_cuda_graph import PROMPTS, _engine  # noqa: E402  (the tiny engine of the decode graph tests)

import mmlora  # noqa: E402
from mmlora.backends import get_backend  # noqa: E402
from mmlora.engine.cuda_graph import CudaGraphRunner  # noqa: E402
from mmlora.forward import stage_policy  # noqa: E402
from mmlora.forward.lora import STAGED_LAYOUTS, LoRAWeights, page_weights  # noqa: E402
from mmlora.lora.pages import pages_for  # noqa: E402
from mmlora.lora.stage import ShrinkStage  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _staged_h(c, positions: dict[int, int], capacity: int) -> torch.Tensor:  # noqa: ANN001
    """h [T, capacity * n * R] as the staged GEMM gives it: x @ A[slot].T (rounded to x.dtype) at each
    staged slot's position, junk (large finite values) at the positions no row reads."""
    rows = c.A.shape[1]
    g = torch.Generator().manual_seed(5)
    h = (torch.rand(c.x.shape[0], capacity * rows, generator=g) * 1e3).to(c.x.dtype).to(c.x.device)
    for slot, pos in positions.items():
        h[:, pos * rows : (pos + 1) * rows] = (c.x.double() @ c.A[slot].double().T).to(c.x.dtype)
    # A wider row stride than the columns, as a view of the GEMM's [T, out + C*n*R] result.
    wide = torch.zeros(h.shape[0], h.shape[1] + 24, dtype=h.dtype, device=h.device)
    wide[:, 24:] = h
    return wide[:, 24:]


@pytest.mark.parametrize("backend", ["triton-sgmv", "triton-auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["decode-distinct-qkv", "decode-basemix-qkv", "decode-identical", "gate-up"])
def test_staged_expand_matches_the_reference(backend: str, dtype: torch.dtype, name: str) -> None:
    """Rows routed as a decode graph's runs (base rows among them), adapters of mixed ranks at shuffled
    stage positions with junk in the others: the fp64 oracle's out, base rows untouched."""
    case = CPU_CASES.get(name, (9, 48, (48, 48), 16, [16, 4, 8], "uniform", "decode"))
    T, in_f, widths, R, ranks, pattern, mode = case
    c = make_case(T, in_f, widths, R, ranks, pattern, mode, dtype)
    rng = random.Random(3)
    slots = sorted(c.token_slots)
    route_as_graph_runs(c, slots)
    capacity = len(ranks) + 2
    order = list(range(capacity))
    rng.shuffle(order)
    positions = {s: order[s] for s in range(len(ranks))}
    h_pos = torch.full((len(ranks),), -1, dtype=torch.int32)
    for s, p in positions.items():
        h_pos[s] = p
    h = _staged_h(c, positions, capacity)
    out0 = c.out.clone()
    _, want = reference(c)
    c.info.graph_layout = "staged"
    get_backend(backend, DEV).add_lora_staged(c.out, h, c.weights, c.info, h_pos.to(DEV))
    assert_out(c, c.out, want, out0)


# (case, page rank U): ranks within a page, whole pages, and ranks ending inside a later page.
PAGED = [
    ("decode-distinct-qkv", 8),
    ((11, 32, (32, 16, 16), 32, [32, 8, 17, 4, 24], "distinct", "decode"), 8),
    ((11, 32, (32, 16, 16), 32, [32, 8, 17, 4, 24], "distinct", "decode"), 16),
    ((9, 48, (48, 48), 16, [16, 3, 9], "uniform", "decode"), 4),
]


@pytest.mark.parametrize("backend", ["triton-sgmv", "triton-auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case,U", PAGED, ids=[f"{i}-U{u}" for i, (_, u) in enumerate(PAGED)])
def test_staged_expand_on_a_paged_pool_matches_the_reference(
    backend: str, dtype: torch.dtype, case, U: int
) -> None:  # noqa: ANN001
    """A paged pool's staged shrink: each slot's pages at consecutive positions (aligned, in shuffled
    order, junk in the positions between), their columns page by page in the order of A's rows; the fp64
    oracle's out over the unpaged pool the pages were made from."""
    c = make_case(*(CPU_CASES[case] if isinstance(case, str) else case), dtype)
    weights = page_weights(c.weights, U)
    route_as_graph_runs(c, sorted(c.token_slots))
    rng = random.Random(4)
    order = list(range(len(c.ranks)))
    rng.shuffle(order)
    order.sort(key=lambda s: c.ranks[s] <= U)  # an adapter of one page last: its load bound passes its page
    positions, cursor = {}, 0
    for s in order:
        k = pages_for(c.ranks[s], U, weights.pages)
        first = -(-(cursor + rng.randint(0, 1)) // k) * k  # aligned to its pages, sometimes after a gap
        positions[s], cursor = first, first + k
    width = weights.n_slices * U
    g = torch.Generator().manual_seed(5)
    # Junk between positions, NaN past the last one: the expand must not read past a slot's own pages
    # (with pages of fewer than 16 ranks its loads are bounded by 16), nor past h's end.
    h = (torch.rand(c.x.shape[0], cursor * width, generator=g) * 1e3).to(dtype).to(c.x.device)
    h = torch.cat([h, torch.full((h.shape[0], 2 * width), float("nan"), dtype=dtype, device=h.device)], 1)
    h = h[:, : cursor * width]
    for s, first in positions.items():
        for page in range(pages_for(c.ranks[s], U, weights.pages)):
            cols = slice((first + page) * width, (first + page + 1) * width)
            h[:, cols] = (c.x.double() @ weights.A[s, page].double().T).to(dtype)
    h_pos = torch.tensor([positions[s] for s in range(len(c.ranks))], dtype=torch.int32)
    out0 = c.out.clone()
    _, want = reference(c)
    c.info.graph_layout = "staged"
    get_backend(backend, DEV).add_lora_staged(c.out, h, weights, c.info, h_pos.to(DEV))
    assert_out(c, c.out, want, out0)


def test_staged_expand_rejects_what_it_cannot_read() -> None:
    c = make_case(*CPU_CASES["decode-distinct-qkv"], torch.float32)
    backend = get_backend("triton-sgmv", DEV)
    h_pos = torch.zeros(len(c.ranks), dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="h must be"):
        backend.add_lora_staged(c.out, torch.zeros(7, 47, device=DEV), c.weights, c.info, h_pos)
    with pytest.raises(ValueError, match="h_pos must be int32"):
        backend.add_lora_staged(c.out, torch.zeros(7, 48, device=DEV), c.weights, c.info, h_pos.long())
    with pytest.raises(NotImplementedError):
        get_backend("torch-gather", DEV).add_lora_staged(c.out, torch.zeros(7, 48), c.weights, c.info, h_pos)


def _module(out_f: int, in_f: int, slots: int, rows: int, bias: bool, seed: int):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        base.weight.copy_(torch.randn(out_f, in_f, generator=g))
    A = torch.randn(slots, rows, in_f, generator=g)
    weights = LoRAWeights(A, torch.zeros(slots, out_f, rows), torch.ones(slots, 1), (0, out_f))
    return base, weights


def test_stage_stacks_the_shrink_under_the_base_weight_and_stages_on_demand() -> None:
    """The base weight keeps its values (now a view of W_cat); one GEMM gives ``x @ W.T + b`` and each
    staged slot's ``x @ A[slot].T`` at its position; a batch's adapters are placed within the narrowest
    staged layout's positions that can hold them (one staged past them is copied again); positions are
    reused least recently used first, never for a slot of the batch, a batch of more adapters than
    positions changes nothing, and a slot the pool rewrote is copied again when it is next used."""
    stage = ShrinkStage(capacity=2, num_slots=4, device=torch.device("cpu"))
    mods = [_module(6, 5, 4, 3, bias=True, seed=0), _module(4, 5, 4, 3, bias=False, seed=1)]
    before = [base.weight.detach().clone() for base, _ in mods]
    staged = [stage.add(base, w) for base, w in mods]
    x = torch.randn(3, 5)
    for (base, _), was, st in zip(mods, before, staged):
        assert torch.equal(base.weight, was) and base.weight.data_ptr() == st.W_cat.data_ptr()
    # 2 positions of 3 rows of 5 inputs a module, and the biased module's 2 * 3 padded bias entries, fp32.
    assert stage.nbytes() == (2 * (2 * 3 * 5) + 2 * 3) * 4

    def check(expect: dict[int, int]) -> None:
        assert {s: stage.position_of(s) for s in range(4) if stage.position_of(s) is not None} == expect
        assert stage.h_pos.tolist() == [expect.get(s, -1) for s in range(4)]
        for (base, w), st in zip(mods, staged):
            y, h = st.linear(x, 2)
            torch.testing.assert_close(y, base(x))
            for s, p in expect.items():
                torch.testing.assert_close(h[:, p * 3 : (p + 1) * 3], x @ w.A[s].T)

    assert stage.ensure([-1, 2, 2]) and stage.copies == 1
    check({2: 0})
    assert stage.ensure([0, 2]) and stage.copies == 2
    check({2: 0, 0: 1})
    assert stage.ensure([2])  # 2 is now the most recent: 0 goes first
    assert stage.ensure([3, 2]) and stage.copies == 3
    check({2: 0, 3: 1})
    assert not stage.ensure([0, 1, 2])  # more adapters than positions
    check({2: 0, 3: 1})
    # One adapter fits the narrowest graph (staged/2, the first position): 3 is copied again there, over 2.
    assert stage.ensure([3]) and stage.copies == 4
    check({3: 0})
    mods[0][1].A[3].add_(1.0)  # the pool writes slot 3 again
    stage.forget(3)
    check({})
    assert stage.ensure([3]) and stage.copies == 5
    check({3: 0})


def test_a_paged_stage_places_each_adapter_on_its_pages() -> None:
    """Paged by 2 ranks, 4 pages a slot: an adapter takes the positions of its pages (rank 1 or 2: one,
    3 or 4: two, 8: four), aligned to their count; each position's columns are ``x @ A[slot, page].T``;
    a batch that does not fit (too many pages) stages nothing; a batch's adapters are placed within the
    narrowest staged layout's positions that can hold them, again together where those kept in place
    leave no window; an adapter evicts the least recently used ones of the window it takes."""
    stage = ShrinkStage(capacity=6, num_slots=8, device=torch.device("cpu"), page_rank=2, max_pages=4)
    g = torch.Generator().manual_seed(2)
    A = torch.randn(8, 4, 2 * 2, 5, generator=g)  # [slots, pages, n * U, in], n = 2
    weights = LoRAWeights(A, torch.zeros(8, 4, 6, 2), torch.ones(8, 2), (0, 3, 6))
    module = stage.add(torch.nn.Linear(5, 6, bias=False), weights)
    pages = {0: 1, 1: 2, 2: 4, 3: 2, 4: 1, 5: 1}
    for slot, rank in enumerate([2, 4, 8, 3, 1, 2, 0, 0]):
        stage.set_rank(slot, rank)
    x = torch.randn(3, 5)

    def check(expect: dict[int, int]) -> None:  # slot -> first position
        assert {s: stage.position_of(s) for s in range(8) if stage.position_of(s) is not None} == expect
        assert stage.h_pos.tolist() == [expect.get(s, -1) for s in range(8)]
        _, h = module.linear(x, 6)
        for s, first in expect.items():
            assert first % pages[s] == 0
            for page in range(pages[s]):
                torch.testing.assert_close(
                    h[:, (first + page) * 4 : (first + page + 1) * 4], x @ A[s, page].T
                )

    assert stage.layouts == ("staged/4", "staged/2", "staged") and stage.width("staged/4") == 1
    assert stage.ensure([0, 1, 0]) and stage.copies == 2
    check({1: 0, 0: 2})  # the larger first, each in the first free aligned window
    assert stage.layout_for([0, 1]) == "staged/2"  # positions 0-2 of 6
    y3, h3 = module.linear(x, 3)  # the GEMM over the first three positions only
    y6, h6 = module.linear(x, 6)
    assert h3.shape == (3, 12) and torch.equal(y3, y6) and torch.equal(h3, h6[:, :12])
    assert not stage.ensure([2, 0, 1])  # 4 + 1 + 2 pages > 6
    assert stage.ensure([2]) and stage.copies == 3  # the only window of four holds 1 and 0: both go
    check({2: 0})
    assert stage.ensure([4, 5, 3]) and stage.copies == 6  # 3 on the free pair, 4 and 5 evict 2
    check({3: 4, 4: 0, 5: 1})
    assert [stage.layout_for(b) for b in ([4], [4, 5], [5, 3], [-1])] == [
        "staged/4",
        "staged/2",
        "staged",
        "staged/4",
    ]
    assert stage.ensure([0]) and stage.copies == 7  # staged/4's one position, over 4
    check({3: 4, 0: 0, 5: 1})
    assert stage.ensure([5, 4]) and stage.copies == 8  # within staged/2's three: 4 on the free one
    check({3: 4, 0: 0, 5: 1, 4: 2})
    # 6 pages in all, and every aligned pair holds one of the batch's own adapters: placed again together,
    # largest first, they fit; 0 and 3 land where they were (not copied again), 4 evicts 5.
    assert stage.ensure([0, 4, 1, 3]) and stage.copies == 10
    check({1: 2, 3: 4, 0: 0, 4: 1})
    # Staged/2's three positions: 1 (past them) moves to the pair 0-1 over 0 and 4, 5 takes the free one.
    assert stage.ensure([1, 5]) and stage.copies == 12
    check({1: 0, 5: 2, 3: 4})
    stage.set_rank(1, 8)  # the pool wrote slot 1 again, with a rank of four pages
    check({5: 2, 3: 4})
    pages[1] = 4
    assert stage.ensure([1]) and stage.copies == 13  # the only window of four: 5 goes
    check({3: 4, 1: 0})


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
    rows not counted), replays the backend's own layout; 0 (the defaults) stages every batch that fits."""
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
    engine = _engine(base, adapters, "cuda", lora_stage_slots=positions, **pool)
    graphs = engine.runner.decode_graphs
    graphs.graphs = KeyLog(graphs.graphs)
    got = _generate(engine)
    used = {layout for _, bound, layout in graphs.graphs.used if bound}
    del engine, graphs
    gc.collect()
    torch.cuda.empty_cache()
    assert_same_outputs(ref, got, 1e-4)
    assert "staged" in used, used


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
