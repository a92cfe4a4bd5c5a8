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
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_group_programs", None)  # this group, not the rule's
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_group_stages", stages)
    c = make_case(*CPU_CASES[name], dtype=dtype, seed=11, pad_value=float("nan"))
    assert c.info.max_seg_len <= 16 or name == "mixed-ranks-1-to-128"
    _, want = reference(c)
    out0 = c.out.clone()
    get_backend("triton-sgmv").add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)


@pytest.mark.parametrize("name,dtype", GROUP_CASES[:4], ids=[f"{n}-{str(d)[6:]}" for n, d in GROUP_CASES[:4]])
def test_sgmv_run_expand_group_by_programs(name: str, dtype: torch.dtype, monkeypatch) -> None:  # noqa: ANN001
    """``run_expand_group_programs``: each launch takes the largest group of 4, 2, 1 that keeps that many
    programs (so the group follows the module's width and the batch's segments), and gives the reference."""
    monkeypatch.setitem(triton_sgmv.TUNING, "block_n", 16)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_group", 2)
    c = make_case(*CPU_CASES[name], dtype=dtype, seed=17, pad_value=float("nan"))
    widths = [b - a for a, b in zip(c.offsets, c.offsets[1:])]
    n, column_tiles, segments = len(widths), -(-max(widths) // 16), c.info.num_segments
    chosen = {}
    for least in (1, segments * n * -(-column_tiles // 2), segments * n * column_tiles, 10**6):
        monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_group_programs", least)
        _, _, kwargs = triton_sgmv._expand_launch(
            (1, 0, 0), c.weights, c.info, c.out.stride(0), c.B.shape[-1]
        )
        chosen[least] = kwargs["N_GROUP"]
        c.info.host_derived.clear()
        out = c.out.clone()
        get_backend("triton-sgmv").add_lora(out, c.x, c.weights, c.info)
        _, want = reference(c)
        assert_out(c, out, want, c.out)
    assert column_tiles >= 3  # so each of the four bounds picks another group
    assert list(chosen.values()) == [4, 2, 1, 1]


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
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_group_programs", None)
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
        assert splits == 16  # 1024 in_features: 16 splits of 64, the most h_unroll 16 sums at once
        # ... more than the waves rule alone gives for the interpreter's 4 SMs (a GPU's SMs may ask 16 too)
        assert c.x.is_cuda or base < 16
    _, want = reference(c)
    out0 = c.out.clone()
    for unroll in (None, 16):
        monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_h_unroll", unroll)
        c.info.host_derived.clear()
        got = out0.clone()
        get_backend("triton-sgmv").add_lora(got, c.x, c.weights, c.info)
        assert_out(c, got, want, out0)
