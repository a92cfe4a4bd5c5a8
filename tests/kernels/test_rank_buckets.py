"""Mixed ranks at the cost of their bytes (issue 23): rank buckets, and Triton LoRA kernels that never use
the rank padding of a slot.

Each slot's A rows and B columns past its adapter's rank are poisoned with NaN: a kernel that lets any of
them reach the sum (even multiplied by zero) returns NaN and fails. The oracle is a plain fp64
per-token, per-slice loop over the contract of :mod:`mmlora.backends.base`. Kernels run under
TRITON_INTERPRET=1 on CPU (tests/conftest.py) at small shapes.
"""

from __future__ import annotations

import random

import pytest
import torch
from lora_pools import nan_padded_pool

from mmlora.backends import get_backend
from mmlora.forward.lora import RUN_TILE, LoRABatchInfo, LoRAWeights, rank_bucket, rank_buckets, slot_runs

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["triton-bgmv", "triton-sgmv", "triton-auto"]


def test_rank_buckets_double_from_16_up_to_the_pool_rank() -> None:
    assert rank_buckets(64) == (16, 32, 64)
    assert rank_buckets(16) == (16,)
    assert rank_buckets(8) == (8,)
    assert rank_buckets(48) == (16, 32, 48)
    assert rank_buckets(256) == (16, 32, 64, 128, 256)
    with pytest.raises(ValueError):
        rank_buckets(0)


@pytest.mark.parametrize(
    "rank,cap,want", [(0, 64, 0), (1, 64, 16), (8, 64, 16), (16, 64, 16), (17, 64, 32), (33, 48, 48), (64, 64, 64),
                      (8, 8, 8), (100, None, 128)],
)  # fmt: skip
def test_rank_bucket_is_the_smallest_bucket_holding_the_rank(rank: int, cap: int | None, want: int) -> None:
    assert rank_bucket(rank, cap) == want
    if cap is not None and rank:
        assert want in rank_buckets(cap)


def test_rank_bucket_refuses_a_rank_above_the_pool() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        rank_bucket(65, 64)


def test_batch_info_carries_the_bucket_of_its_largest_rank() -> None:
    info = LoRABatchInfo(16, 4, "cpu", max_lora_rank=64)
    for slot, r in enumerate([8, 64, 20, 16]):
        info.set_slot_rank(slot, r)
    info.fill([3, 1], [0, -1])
    assert (info.max_rank, info.rank_bound) == (8, 16)
    info.fill([1, 1, 2], [3, 2, 0])
    assert (info.max_rank, info.rank_bound) == (20, 32)
    info.fill([1, 1], [-1, -1])
    assert (info.max_rank, info.rank_bound, info.has_lora) == (0, 0, False)
    assert info.bound_of([0, -1, 1]) == 64 and info.bound_of([0, 3]) == 16 and info.bound_of([-1]) == 0
    info.fill_rows([0, -1, 3], 16)  # the graph path: the bound is the graph's, fixed at capture
    assert (info.max_rank, info.rank_bound, info.num_segments) == (16, 16, 3)


def _case(ranks: list[int], R: int, widths: tuple[int, ...], in_f: int, seed: int):
    """Pool of len(ranks) slots of rank R; everything past each slot's rank is NaN."""
    return nan_padded_pool(ranks, R, widths, in_f, seed)


def _reference(x, A, B, scalings, offs, ranks, token_slots) -> torch.Tensor:  # noqa: ANN001
    """``x @ A[s, slice, :r].T @ B[s, slice, :, :r].T * scaling`` per token and slice, in fp64."""
    R = B.shape[2]
    delta = torch.zeros(x.shape[0], offs[-1], dtype=torch.float64)
    for t, s in enumerate(token_slots):
        if s < 0:
            continue
        r = ranks[s]
        for i in range(len(offs) - 1):
            h = x[t].double() @ A[s, i * R : i * R + r].double().T
            delta[t, offs[i] : offs[i + 1]] = (
                B[s, offs[i] : offs[i + 1], :r].double() @ h * float(scalings[s, i])
            )
    return delta


def test_runs_layout_merges_adjacent_rows_up_to_the_run_tile() -> None:
    """The ``runs`` layout: segments are runs of one slot cut at RUN_TILE rows; the other segment
    entries are empty (no rows, slot -1), and the host ints are the worst case a capture bakes in."""
    assert slot_runs([3, 3, -1, -1, 0, 3]) == [(3, 2), (-1, 2), (0, 1), (3, 1)]
    assert slot_runs([5] * (RUN_TILE + 3)) == [(5, RUN_TILE), (5, 3)]
    n = RUN_TILE + 5
    info = LoRABatchInfo(n + 3, 6, "cpu", max_lora_rank=64)
    slots = [-1] * 2 + [1] * (RUN_TILE + 1) + [4, 4]
    info.fill_rows(slots, 16, "runs")
    runs = [(-1, 2), (1, RUN_TILE), (1, 1), (4, 2)]
    shape = (info.num_tokens, info.num_segments, info.max_seg_len, info.graph_layout)
    assert shape == (n, n, RUN_TILE, "runs")
    indptr = [0, 2, 2 + RUN_TILE, 3 + RUN_TILE, n] + [n] * (n - 4)
    assert info.seg_indptr[: n + 1].tolist() == indptr
    assert info.seg_lens[:n].tolist() == [2, RUN_TILE, 1, 2] + [0] * (n - 4)
    assert info.weight_indices[:n].tolist() == [s for s, _ in runs] + [-1] * (n - 4)
    assert info.token_slots[:n].tolist() == slots
    info.fill_rows(slots, 16, "runs", segments=6)  # fewer entries: the same runs, fewer empty ones
    assert (info.num_segments, info.seg_lens[:6].tolist()) == (6, [2, RUN_TILE, 1, 2, 0, 0])
    assert info.seg_indptr[:7].tolist() == indptr[:7]
    with pytest.raises(ValueError, match="4 runs need segments"):
        info.fill_rows(slots, 16, "runs", segments=3)
    info.fill_rows(slots, 16)  # rows: one segment per row again
    assert info.seg_lens[:n].tolist() == [1] * n and info.weight_indices[:n].tolist() == slots
    assert info.num_segments == n
    assert info.graph_layout == "rows"
    info.fill([2, 1], [1, -1])
    assert info.graph_layout is None
    with pytest.raises(ValueError, match="layout"):
        info.fill_rows(slots, 16, "columns")


# (ranks per slot, pool rank R, slice widths, in_features): the {8, 64} mix of the issue, ranks that end
# inside a 16-wide rank tile (1, 17, 33), and a pool whose rank is below one tile.
POOLS = {
    "mix-8-64-qkv": ([8, 64, 8, 64], 64, (32, 16, 16), 64),
    "odd-ranks-gateup": ([1, 17, 33, 64, 16], 64, (24, 24), 48),
    "pool-rank-8": ([8, 3, 8], 8, (40,), 32),
    # Only small ranks in a rank-64 pool: the batch's bucket (16, or 32) sizes the tiles, and the fused
    # path leaves h past the bucket unwritten.
    "small-ranks-in-64": ([8, 16, 1, 13], 64, (32, 16, 16), 64),
    "up-to-32-in-64": ([17, 8, 32], 64, (24, 24), 48),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("mode", ["decode", "prefill", "graph", "graph-runs"])
def test_padding_beyond_each_slot_rank_is_never_used(backend: str, pool: str, mode: str) -> None:
    """Mixed ranks in one batch, NaN past every slot's rank: out matches the oracle and base rows stay
    bit-identical. ``graph`` is a CUDA-graph step: rows filled by ``fill_rows`` with the pool's largest
    rank bound while the batch's own ranks are smaller; ``graph-runs`` the same in the ``runs`` layout,
    rows sorted by slot as the graph runner orders them, with a run longer than RUN_TILE (cut in two)."""
    ranks, R, widths, in_f = POOLS[pool]
    rng = random.Random(sum(map(ord, pool + mode)))
    A, B, scalings, offs = _case(ranks, R, widths, in_f, seed=len(pool))
    S = len(ranks)
    if mode == "prefill":
        lens = [rng.randint(1, 9) for _ in range(5)]
    else:
        lens = [1] * (RUN_TILE + 12 if mode == "graph-runs" else 7)
    slots = [rng.randrange(-1, S) for _ in lens]
    slots[0] = 0  # at least one adapter row (slot 0 has a rank below the pool's in every pool)
    if mode == "graph-runs":
        slots[1 : RUN_TILE + 3] = [0] * (RUN_TILE + 2)
        slots.sort()
    info = LoRABatchInfo(sum(lens) + 3, S, DEV, max_lora_rank=R)
    for s, r in enumerate(ranks):
        info.set_slot_rank(s, r)
    if mode.startswith("graph"):
        info.fill_rows(slots, rank_buckets(R)[-1], "runs" if mode == "graph-runs" else "rows")
    else:
        info.fill(lens, slots)
    token_slots = [s for n, s in zip(lens, slots) for _ in range(n)]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(token_slots), in_f, generator=g)
    out0 = torch.randn(len(token_slots), offs[-1], generator=g)
    want = out0.double() + _reference(x, A, B, scalings, offs, ranks, token_slots)
    out = out0.to(DEV).clone()
    weights = LoRAWeights(A.to(DEV), B.to(DEV), scalings.to(DEV), offs)
    get_backend(backend).add_lora(out, x.to(DEV), weights, info)
    got = out.double().cpu()
    assert torch.isfinite(got).all(), "rank padding (NaN) reached the output"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    base = torch.tensor([s < 0 for s in token_slots])
    assert torch.equal(out.cpu()[base], out0[base]), "rows without an adapter were modified"


@pytest.mark.parametrize("bound", [16, 32, 64])
def test_bgmv_shrink_grid_follows_the_rank_bound_not_the_pool_rank(bound: int) -> None:
    """The shrink launches one program per 16-rank tile up to the batch's bound: a rank-16 batch in a
    rank-64 pool launches a quarter of the programs a rank-64 batch does."""
    from mmlora.backends.triton_bgmv import _ShrinkPlan

    plan = _ShrinkPlan(T=8, in_features=4096, n=3, R=64, bound=bound, device=torch.device("cpu"), split_k=1)
    assert plan.block_r == 16 and plan.r_tiles == bound // 16


@pytest.mark.parametrize("R,bound", [(64, 16), (64, 32), (64, 64), (16, 16)])
def test_expand_and_sgmv_shrink_tiles_follow_the_batch_rank_bucket(R: int, bound: int) -> None:
    """A batch whose ranks fit bucket ``bound`` of a rank-R pool gets the tiles of a rank-``bound`` pool
    (issue 23: a rank-16 batch of a rank-64 pool ran 2x as long in the BGMV expand with rank-64 tiles)."""
    from mmlora.backends.triton_bgmv import _expand
    from mmlora.backends.triton_common import ShrinkJob
    from mmlora.backends.triton_sgmv import _expand_launch, _shrink_launch

    S, in_f, offs = 2, 64, (0, 32, 64)
    info = LoRABatchInfo(8, S, torch.device("cpu"), max_lora_rank=R)
    info.set_slot_rank(0, bound)
    info.fill([1, 1], [0, 0])
    assert info.rank_bound == bound
    A = torch.zeros(S, 2 * R, in_f)
    w = LoRAWeights(A, torch.zeros(S, 64, R), torch.ones(S, 2), offs)
    job = ShrinkJob(torch.zeros(2, in_f), A, info, 2, R, True, None)
    grid, _, kw, shape, _ = _shrink_launch(job, fp32_planes=True, whole_rank=False)
    assert kw["BLOCK_R"] == min(bound, 64) and shape[2] == 2 * R  # h keeps the pool's layout
    assert grid[0] % (bound // kw["BLOCK_R"]) == 0
    whole, *_ = _shrink_launch(job, fp32_planes=True, whole_rank=True)
    assert whole[0] == grid[0] * (R // bound)  # the public shrink still writes every column up to R
    _, _, kw = _expand_launch((1, 2 * R, 2 * R), w, info, 64, R)
    assert kw["BLOCK_K"] == min(bound, 32 if info.max_seg_len <= 16 else 64)

    seen = {}

    class Stop(Exception):
        pass

    def plan(grid, args, kwargs, tensor_args):  # noqa: ANN001, ANN202
        seen.update(kwargs)
        raise Stop

    import mmlora.backends.triton_bgmv as bgmv

    kernel = bgmv.fast(bgmv._bgmv_expand_kernel)
    original, kernel.plan = kernel.plan, plan
    try:
        with pytest.raises(Stop):
            _expand(torch.zeros(1, 2, 2 * R), w, info, torch.zeros(2, 64), R, torch.float32)
    finally:
        kernel.plan = original
    assert seen["BLOCK_R"] == min(bound, 32) and seen["BLOCK_N"] == 4096 // seen["BLOCK_R"]


def test_triton_auto_captures_runs_graphs_with_half_the_segment_entries() -> None:
    """triton-auto replays a runs graph only when rows >= 2 x runs, so its runs graphs need at most half
    the rows as segment entries (half the SGMV programs, most of them empty); rows graphs keep one per row
    and SGMV alone (runs at any count) keeps one per row too."""
    auto, sgmv = get_backend("triton-auto"), get_backend("triton-sgmv")
    for rows in (1, 2, 5, 128):
        assert auto.graph_segments(rows, "runs") == max(1, rows // 2)
        assert auto.graph_segments(rows, "rows") == rows
        assert sgmv.graph_segments(rows, "runs") == rows
        for runs in range(1, rows + 1):  # whenever auto picks runs, they fit its entries
            if auto.graph_layout(rows, runs) == "runs":
                assert runs <= auto.graph_segments(rows, "runs")
