"""The staged shrink (``lora_stage_slots``, :mod:`mmlora.lora.stage`): the base GEMM over ``[W; A_stage]``
gives the base output and every staged adapter's shrink, and the expand reads each row's own columns.

Oracles: the fp64 per-token loop of ``lora_cases.py`` for the staged expand; plain matmuls for the stage's
GEMM and its bookkeeping; the ordinary eager engine (no stage) for the decode graph runner's ``staged``
layout (in ``test_lora_stage_engine.py``, with the engine's other stage tests).
"""

from __future__ import annotations

import os
import random

import torch

if not torch.cuda.is_available():  # must precede the first triton import of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from lora_cases import CPU_CASES, DEV, assert_out, make_case, reference, route_as_graph_runs  # noqa: E402

from mmlora.backends import get_backend  # noqa: E402
from mmlora.forward.lora import LoRAWeights, page_weights  # noqa: E402
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
