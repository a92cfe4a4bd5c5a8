"""SGMV's decode-run knobs (``TUNING["run_*"]``: tiles of at most 16 tokens a run of rows on one adapter)
against the fp64 per-token oracle of ``lora_cases.py``, NaN rank padding included: each knob is off by
default until a GPU A/B makes it one, so each must give the reference on and off."""

from __future__ import annotations

import pytest
import torch
from lora_cases import (
    CPU_CASES,
    Case,
    assert_out,
    make_case,
    reference,
)

from mmlora.backends import get_backend, triton_sgmv
from mmlora.backends.triton_common import ShrinkJob


# Shared memory: an fp32 shrink tile of 512 in_features over qkv's rank-16 slices needs 163 KB a stage, so
# 512 runs one stage and 256 two (an H200 has 227 KB a block; 256 x 4 stages failed there, session 19).
@pytest.mark.parametrize(
    "block_k,waves,early_out,stages", [(256, None, True, 2), (512, 8, False, 1), (None, 8, True, 3)]
)
@pytest.mark.parametrize("name", ["decode-wide-in-qkv", "prefill-zipf-single", "decode-distinct-qkv"])
def test_sgmv_run_knobs(
    name: str, block_k: int | None, waves: int | None, early_out: bool, stages: int | None, monkeypatch
) -> None:  # noqa: ANN001
    """SGMV's own knobs for 16-token tiles (``run_shrink_block_k``, ``run_waves``, ``run_shrink_stages``,
    ``run_expand_early_out``; off by default, for a GPU sweep) give the reference too, NaN padding
    included."""
    monkeypatch.setitem(triton_sgmv.TUNING, "run_shrink_stages", stages)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_shrink_block_k", block_k)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_waves", waves)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_early_out", early_out)
    c = make_case(*CPU_CASES[name], dtype=torch.float32, seed=7, pad_value=float("nan"))
    assert c.info.max_seg_len <= 16  # the batches these knobs apply to
    _, want = reference(c)
    out0 = c.out.clone()
    get_backend("triton-sgmv").add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)


GROUP_CASES = [
    ("decode-distinct-qkv", torch.float32),
    ("decode-distinct-qkv", torch.bfloat16),
    ("decode-zipf-single", torch.float32),
    ("decode-basemix-qkv", torch.float32),
    ("decode-wide-in-qkv", torch.float32),
    ("mixed-ranks-1-to-128", torch.float32),  # rank bucket 128: more than one rank step, so not grouped
]


@pytest.mark.parametrize("b_first", [False, True])
@pytest.mark.parametrize("group,stages", [(2, 2), (3, 1), (8, 3)])
@pytest.mark.parametrize("name,dtype", GROUP_CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in GROUP_CASES])
def test_sgmv_run_expand_groups(
    name: str, dtype: torch.dtype, group: int, stages: int, b_first: bool, monkeypatch
) -> None:  # noqa: ANN001
    """``run_expand_group``: an expand program over several column tiles (h loaded once, B and out
    streamed; with ``run_expand_group_b_first`` the first tile's loads issued before h's) gives the
    reference, NaN padding included. 16-column tiles, so the slices of 16-64 columns make groups that are
    full, partial and past a slice's end."""
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_group_b_first", b_first)
    monkeypatch.setitem(triton_sgmv.TUNING, "block_n", 16)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_group", group)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_group_stages", stages)
    c = make_case(*CPU_CASES[name], dtype=dtype, seed=11, pad_value=float("nan"))
    assert c.info.max_seg_len <= 16 or name == "mixed-ranks-1-to-128"
    _, want = reference(c)
    out0 = c.out.clone()
    get_backend("triton-sgmv").add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)


# Splits of at most 4 where in_features is 32-64; decode-wide-in-qkv's 1024 make 8, as serving's decode runs.
H_UNROLL_CASES = [
    (name, dtype, *knobs)
    for name, dtype in [
        ("decode-distinct-qkv", torch.float32),
        ("decode-basemix-qkv", torch.bfloat16),
        ("decode-zipf-single", torch.float32),
    ]
    for knobs in [(16, 3, 1), (4, 4, 2), (2, 4, 2)]
] + [("decode-wide-in-qkv", torch.bfloat16, 16, 8, 2), ("decode-wide-in-qkv", torch.float32, 4, 8, 1)]


@pytest.mark.parametrize("name,dtype,unroll,split_k,group", H_UNROLL_CASES)
def test_sgmv_run_expand_h_unroll(
    name: str, dtype: torch.dtype, unroll: int, split_k: int, group: int, monkeypatch
) -> None:  # noqa: ANN001
    """``run_expand_h_unroll``: decode-run expands summing h's split-K planes with unrolled loads (more
    planes than unrolled: the loop) give the reference, NaN padding included, and the looped sum's bits."""
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_group", group)
    c = make_case(*CPU_CASES[name], dtype=dtype, seed=13, pad_value=float("nan"))
    assert c.info.max_seg_len <= 16  # the batches the knob applies to
    _, want = reference(c)
    out0 = c.out.clone()
    backend = get_backend("triton-sgmv")
    monkeypatch.setattr(backend, "split_k", split_k)
    looped = c.out.clone()
    backend.add_lora(looped, c.x, c.weights, c.info)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_h_unroll", unroll)
    c.info.host_derived.clear()  # the launch plans of this forward, made with the knob off
    backend.add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)
    assert torch.equal(c.out.nan_to_num(), looped.nan_to_num())


def _shrink_splits(c: Case) -> int:
    """The split-K planes SGMV's shrink would make for ``c`` under the current TUNING."""
    job = ShrinkJob(c.x, c.weights.A, c.info, c.weights.n_slices, c.weights.A.shape[-2] // c.weights.n_slices,
                    True, None)  # fmt: skip
    return triton_sgmv._shrink_launch(job, fp32_planes=True)[3][0]


@pytest.mark.parametrize("cap", [None, 256, 64, 16])
@pytest.mark.parametrize("name", ["decode-wide-in-qkv", "decode-basemix-qkv", "prefill-zipf-single"])
def test_sgmv_run_shrink_k_per_split(name: str, cap: int | None, monkeypatch) -> None:  # noqa: ANN001
    """``run_shrink_k_per_split``: a decode-run shrink splits in_features into at least in_features / cap
    parts (within ``max_split_k`` and whole blocks), never fewer than the waves rule gives; other batches
    keep their split; and the sums (up to 16 planes, unrolled or looped) give the reference, NaN padding
    included."""
    monkeypatch.setitem(triton_sgmv.TUNING, "run_shrink_block_k", 32)
    c = make_case(*CPU_CASES[name], dtype=torch.float32, seed=17, pad_value=float("nan"))
    runs = c.info.max_seg_len <= 16
    base = _shrink_splits(c)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_shrink_k_per_split", cap)
    in_f = c.x.shape[1]
    blocks = -(-in_f // 32)  # run_shrink_block_k above (decode runs; the cap applies to nothing else)
    floor = min(-(-in_f // cap), triton_sgmv.TUNING["max_split_k"], blocks) if cap and runs else 1
    splits = _shrink_splits(c)
    assert splits == max(base, floor)
    if name == "decode-wide-in-qkv" and cap == 64:
        assert splits == 16 > base  # 1024 in_features: 16 splits of 64, the most h_unroll 16 sums at once
    _, want = reference(c)
    out0 = c.out.clone()
    for unroll in (None, 16):
        monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_h_unroll", unroll)
        c.info.host_derived.clear()
        got = out0.clone()
        get_backend("triton-sgmv").add_lora(got, c.x, c.weights, c.info)
        assert_out(c, got, want, out0)


# Decode runs over rank buckets above the expand's rank step (32): the batches the knob applies to.
REDUCE_SPECS = {
    "wide-in": (5, 1024, (32, 16, 16), 64, [64, 8, 40], "distinct", "decode"),
    "base-mix": (7, 64, (64, 16, 16), 64, [64, 4, 33], "base_mix", "decode"),  # base-only tiles: zeros
    "zipf": (40, 32, (40,), 64, [64, 1, 17, 64, 2], "zipf", "decode"),
    "mixed-ranks": (9, 96, (32, 16, 16), 64, [1, 64, 33, 8, 16], "distinct", "decode"),  # two rank tiles
}
REDUCE_CASES = [
    ("wide-in", torch.bfloat16, 8, 32),
    ("wide-in", torch.float32, 16, 16),
    ("base-mix", torch.float32, 4, 32),
    ("zipf", torch.float16, 2, 16),
    ("mixed-ranks", torch.float32, 3, 32),
    ("mixed-ranks", torch.bfloat16, 6, 16),
]


@pytest.mark.parametrize(
    "name,dtype,split_k,rank_step",
    REDUCE_CASES,
    ids=[f"{c[0]}-{str(c[1])[6:]}-{c[2]}-{c[3]}" for c in REDUCE_CASES],
)
def test_sgmv_run_shrink_reduce(
    name: str, dtype: torch.dtype, split_k: int, rank_step: int, monkeypatch
) -> None:  # noqa: ANN001
    """``run_shrink_reduce``: the last split of each decode-run tile sums the planes itself, so the expand
    reads one plane. Against the fp64 oracle (NaN rank padding included) and bit for bit against the
    expand's own sum; twice in a row, so the counters must be back at 0; and they are all 0 after."""
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_rank_step", rank_step)
    c = make_case(*REDUCE_SPECS[name], dtype=dtype, seed=19, pad_value=float("nan"))
    assert c.info.max_seg_len <= 16  # the batches the knob applies to
    _, want = reference(c)
    out0 = c.out.clone()
    backend = get_backend("triton-sgmv")
    monkeypatch.setattr(backend, "split_k", split_k)
    planes = out0.clone()
    backend.add_lora(planes, c.x, c.weights, c.info)
    monkeypatch.setitem(
        triton_sgmv.TUNING, "run_shrink_reduce", 0
    )  # wherever there is more than one rank step
    c.info.host_derived.clear()  # the launch plans of this forward, made with the knob off
    for _ in range(2):
        got = out0.clone()
        backend.add_lora(got, c.x, c.weights, c.info)
        assert_out(c, got, want, out0)
        assert torch.equal(got.nan_to_num(), planes.nan_to_num())
    plans = [p for p in c.info.host_derived.values() if isinstance(p, triton_sgmv._ModulePlan)]
    assert plans and all(p.reduce for p in plans)  # the summing shrink ran, not the planes' path
    counters = backend._split_counters.get(c.x.device, 1)
    assert int(counters.count_nonzero()) == 0


def test_sgmv_shrink_reduce_where_it_pays(monkeypatch) -> None:  # noqa: ANN001
    """The knob applies to decode runs split over in_features whose expand has more than one rank step in
    at least ``run_shrink_reduce`` programs per SM; a prefill (its tiles not one run each), a single rank
    step, a fewer-program expand and the plain ``sgmv_shrink`` (no counters) keep the planes' path."""
    counters = triton_sgmv.SplitCounters()
    monkeypatch.setattr(triton_sgmv, "sm_count", lambda device: 4)

    def reduced(spec: tuple, split_k: int) -> bool:
        c = make_case(*spec, dtype=torch.float32, seed=3)
        R = c.weights.A.shape[-2] // c.weights.n_slices
        job = ShrinkJob(c.x, c.weights.A, c.info, c.weights.n_slices, R, True, split_k)
        plan = triton_sgmv._ModulePlan(job, c.weights, c.out.stride(0), False, counters=counters)
        assert triton_sgmv._shrink_launch(job, fp32_planes=True)[2]["REDUCE"] is False
        return plan.reduce

    wide = REDUCE_SPECS["wide-in"]  # 3 slices x 1 tile of 256 columns x 5 tiles: 15 expand programs
    monkeypatch.setitem(triton_sgmv.TUNING, "run_shrink_reduce", None)
    assert not reduced(wide, 4)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_shrink_reduce", 3)  # 12 programs on 4 SMs: pays
    assert reduced(wide, 4)
    assert not reduced(wide, 1)  # one split: nothing to sum
    assert not reduced(CPU_CASES["decode-wide-in-qkv"], 4)  # rank bucket 16: one rank step
    assert not reduced((133, 64, (64, 16, 16), 64, [64, 8, 2, 16], "uniform", "prefill"), 4)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_shrink_reduce", 4)  # 16 programs needed, 15 there
    assert not reduced(wide, 4)
