"""SGMV's hybrid path (issue 13): long segments through dense per-segment GEMMs
(:mod:`mmlora.backends.dense_segments`), the rest through the SGMV kernels over a tile table that leaves
the long ones out. Checked against a plain fp64 loop over the contract of :mod:`mmlora.backends.base`
with the threshold lowered to tiny sizes, over adapter popularity, mixed ranks (weights past each rank
poisoned with NaN), base rows, packed modules of equal (gate_up) and unequal (qkv) slices, fp32 and
bf16. Triton runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py)."""

from __future__ import annotations

import random

import pytest
import torch

from mmlora.backends import get_backend, triton_sgmv
from mmlora.backends.dense_segments import dense_segments_lora, long_segments
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (6e-2, 4e-2)}
MIN_SEG = 9  # the threshold under test: chunks of 9+ tokens go dense


def make_pool(in_f: int, widths: tuple[int, ...], R: int, ranks: list[int], seed: int) -> LoRAWeights:
    """fp32 CPU pool, rows/columns past each slot's rank NaN (any read of them shows in the result)."""
    g = torch.Generator().manual_seed(seed)
    n = len(widths)
    offs = tuple([0] + [sum(widths[: i + 1]) for i in range(n)])
    A = torch.full((len(ranks), n * R, in_f), float("nan"))
    B = torch.full((len(ranks), offs[-1], R), float("nan"))
    for s, r in enumerate(ranks):
        for i in range(n):
            A[s, i * R : i * R + r] = torch.randn(r, in_f, generator=g) / in_f**0.5
            B[s, offs[i] : offs[i + 1], :r] = torch.randn(widths[i], r, generator=g) / max(r, 1) ** 0.5
    return LoRAWeights(A, B, torch.rand(len(ranks), n, generator=g) + 0.5, offs)


def reference(x: torch.Tensor, w: LoRAWeights, out: torch.Tensor, token_slots: list[int], ranks: list[int]):
    """fp64 ``out + lora(x)``, h rounded to x.dtype as the contract says."""
    R, n, offs = w.B.shape[2], w.n_slices, w.slice_offsets
    x64, A, B, want = x.double().cpu(), w.A.double().cpu(), w.B.double().cpu(), out.double().cpu().clone()
    for t, s in enumerate(token_slots):
        if s < 0:
            continue
        r = ranks[s]
        for i in range(n):
            h = (x64[t] @ A[s, i * R : i * R + r].T).to(x.dtype).double()
            want[t, offs[i] : offs[i + 1]] += (B[s, offs[i] : offs[i + 1], :r] @ h) * float(w.scalings[s, i])
    return want


# (in, slice widths, pool rank, slot ranks, request token counts, popularity)
CASES = {
    "qkv-mixed-step-distinct": (32, (24, 8, 8), 16, [16, 8, 16, 3], [1, 1, 1, 1, 20, 1, 1], "distinct"),
    "gateup-two-chunks-mixed-ranks": (24, (20, 20), 16, [8, 16, 5], [1, 13, 1, 1, 11, 1], "distinct"),
    "single-prefill-skewed": (40, (17,), 16, [16, 8], [9, 12, 3, 10], "skewed"),
    "qkv-base-rows-and-base-chunk": (32, (16, 8, 8), 16, [16, 4, 16], [1, 14, 1, 10, 1, 1, 9], "base_mix"),
    "gateup-identical": (16, (12, 12), 16, [16], [1, 1, 30, 2], "identical"),
    "qkv-all-long": (32, (24, 8, 8), 16, [16, 8], [12, 10], "distinct"),
}


def slots_of(pattern: str, n_req: int, num_slots: int, rng: random.Random) -> list[int]:
    if pattern == "distinct":
        return [i % num_slots for i in range(n_req)]
    if pattern == "identical":
        return [0] * n_req
    if pattern == "skewed":
        return rng.choices(range(num_slots), weights=[4, 1][:num_slots], k=n_req)
    if pattern == "base_mix":  # every third request base-only, the long base-only chunk included
        return [-1 if i % 3 == 1 else rng.randrange(num_slots) for i in range(n_req)]
    raise ValueError(pattern)


def build(name: str, dtype: torch.dtype, seed: int = 0):
    in_f, widths, R, ranks, lens, pattern = CASES[name]
    rng = random.Random(seed)
    w32 = make_pool(in_f, widths, R, ranks, seed)
    w = LoRAWeights(w32.A.to(DEV, dtype), w32.B.to(DEV, dtype), w32.scalings.to(DEV), w32.slice_offsets)
    slots = slots_of(pattern, len(lens), len(ranks), rng)
    info = LoRABatchInfo(sum(lens) + 4, len(ranks), DEV, R)
    for s, r in enumerate(ranks):
        info.set_slot_rank(s, r)
    info.fill(lens, slots)
    token_slots = [s for n, s in zip(lens, slots) for _ in range(n)]
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sum(lens), in_f, generator=g).to(DEV, dtype)
    out = torch.randn(sum(lens), w.B.shape[1], generator=g).to(DEV, dtype)
    return x, w, out, info, token_slots, ranks


def check(got: torch.Tensor, want: torch.Tensor, out0: torch.Tensor, token_slots: list[int]) -> None:
    atol, rtol = TOL[got.dtype]
    assert torch.isfinite(got.double()).all(), "a weight past a slot's rank reached the sum"
    torch.testing.assert_close(got.double().cpu(), want, atol=atol, rtol=rtol)
    base = torch.tensor([s < 0 for s in token_slots])
    assert torch.equal(got[base].cpu(), out0[base].cpu()), "rows without an adapter were modified"


@pytest.fixture
def hybrid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(triton_sgmv.TUNING, "dense_min_seg", MIN_SEG)


@pytest.mark.parametrize("backend", ["triton-sgmv", "triton-auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_matches_reference(hybrid: None, backend: str, dtype: torch.dtype, name: str) -> None:
    if backend == "triton-auto" and dtype != torch.float32:
        pytest.skip("triton-auto takes SGMV's path for these batches; fp32 shows it")
    x, w, out, info, token_slots, ranks = build(name, dtype)
    if backend == "triton-auto":
        assert get_backend(backend).pick(info).name == "triton-sgmv"
    want = reference(x, w, out, token_slots, ranks)
    out0 = out.clone()
    get_backend(backend).add_lora(out, x, w, info)
    check(out, want, out0, token_slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "name", ["qkv-mixed-step-distinct", "gateup-two-chunks-mixed-ranks", "single-prefill-skewed"]
)
def test_dense_segments_alone_match_reference_on_their_rows(dtype: torch.dtype, name: str) -> None:
    """The dense half on its own: exactly the long segments' rows change, as the contract says."""
    x, w, out, info, token_slots, ranks = build(name, dtype, seed=5)
    segs = long_segments(info, MIN_SEG)
    assert segs and all(n >= MIN_SEG and s >= 0 for _, n, s in segs)
    dense_rows = [False] * len(token_slots)
    for t0, n, _ in segs:
        dense_rows[t0 : t0 + n] = [True] * n
    only = [s if d else -1 for s, d in zip(token_slots, dense_rows)]
    want = reference(x, w, out, only, ranks)
    out0 = out.clone()
    dense_segments_lora(out, x, w, info.ranks_host, segs)
    check(out, want, out0, only)


def test_long_segments_come_from_the_host_mirrors_and_skip_base_rows() -> None:
    info = LoRABatchInfo(64, 4, "cpu")
    for s in range(4):
        info.set_slot_rank(s, 16)
    info.fill([1, 12, 1, 9, 9, 3, 20], [0, 1, 2, 2, 3, -1, -1])
    # Adjacent requests on one slot merge (1 + 9 on slot 2); the base-only runs merge and are skipped.
    assert long_segments(info, 9) == ((1, 12, 1), (13, 10, 2), (23, 9, 3))
    assert long_segments(info, 11) == ((1, 12, 1),)
    assert long_segments(info, 0) == ()


def test_all_long_batch_launches_no_kernel(hybrid: None, monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, out, info, token_slots, ranks = build("qkv-all-long", torch.float32)
    want = reference(x, w, out, token_slots, ranks)

    def no_launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("SGMV launched for a batch whose segments all went dense")

    monkeypatch.setattr(triton_sgmv, "_shrink_planes", no_launch)
    out0 = out.clone()
    get_backend("triton-sgmv").add_lora(out, x, w, info)
    check(out, want, out0, token_slots)


def test_graph_steps_and_threshold_zero_keep_the_kernels(
    hybrid: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA-graph fills (graph_layout set) never take the dense path, nor any batch with it turned off."""

    def no_dense(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("dense path taken")

    monkeypatch.setattr(triton_sgmv, "dense_segments_lora", no_dense)
    x, w, out, info, token_slots, ranks = build("qkv-mixed-step-distinct", torch.float32)
    monkeypatch.setitem(triton_sgmv.TUNING, "dense_min_seg", 0)
    want = reference(x, w, out, token_slots, ranks)
    out0 = out.clone()
    get_backend("triton-sgmv").add_lora(out, x, w, info)
    check(out, want, out0, token_slots)
    monkeypatch.setitem(triton_sgmv.TUNING, "dense_min_seg", 1)
    slots = [0, 1, 1, 2, -1, 3]
    info.fill_rows(slots, 16, "runs")
    xs, outs = x[: len(slots)], out[: len(slots)].clone()
    want = reference(xs, w, outs, slots, ranks)
    out0 = outs.clone()
    get_backend("triton-sgmv").add_lora(outs, xs, w, info)
    check(outs, want, out0, slots)
