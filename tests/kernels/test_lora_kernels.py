"""LoRA backends (torch-gather, triton-sgmv, triton-bgmv) against a plain fp64 per-token loop.

The oracle follows the contract in :mod:`mmlora.backends.base` token by token, independent of any
backend: ``h = x @ A[slot, slice, :rank].T`` rounded to x.dtype, then
``out += h @ B[slot, slice, :, :rank].T * scaling``; rows with slot -1 stay bit-identical.
On CPU the Triton kernels run under TRITON_INTERPRET=1 at tiny shapes; the ``gpu`` cases run at
Mistral-7B projection shapes on CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402

import pytest  # noqa: E402

from mmlora.backends import get_backend, triton_bgmv, triton_sgmv  # noqa: E402
from mmlora.backends.torch_gather import gather_expand, gather_shrink  # noqa: E402
from mmlora.backends.triton_bgmv import bgmv_expand, bgmv_shrink  # noqa: E402
from mmlora.backends.triton_common import ShrinkJob  # noqa: E402
from mmlora.backends.triton_sgmv import sgmv_expand, sgmv_shrink  # noqa: E402
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
BACKENDS = ["torch-gather", "triton-sgmv", "triton-bgmv"]
TRITON = ["triton-sgmv", "triton-bgmv"]
# Each backend's two kernel entry points (its private split of add_lora), tested on their own too.
SHRINK_EXPAND = {
    "torch-gather": (gather_shrink, gather_expand),
    "triton-sgmv": (sgmv_shrink, sgmv_expand),
    "triton-bgmv": (bgmv_shrink, bgmv_expand),
}
# (atol, rtol) on out, relative to the fp64 oracle that rounds h to the input dtype like the kernels.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (6e-2, 4e-2)}


def slots_for(pattern: str, n_req: int, num_slots: int, rng: random.Random) -> list[int]:
    """Adapter popularity: which slot each request uses (-1 = base model only)."""
    if pattern == "distinct":
        return [i % num_slots for i in range(n_req)]
    if pattern == "uniform":
        return [rng.randrange(num_slots) for _ in range(n_req)]
    if pattern == "zipf":
        weights = [1.0 / (k + 1) ** 1.5 for k in range(num_slots)]
        return rng.choices(range(num_slots), weights=weights, k=n_req)
    if pattern == "identical":
        return [0] * n_req
    if pattern == "base_mix":
        return [rng.randrange(-1, num_slots) if i % 3 else -1 for i in range(n_req)]
    if pattern == "all_base":
        return [-1] * n_req
    raise ValueError(pattern)


def split_tokens(T: int, mode: str, rng: random.Random) -> list[int]:
    """Per-request token counts summing to T: one token each (decode), random runs (prefill), or a
    mixed step: decode rows around one long prefill chunk (T > 8)."""
    if mode == "decode":
        return [1] * T
    if mode == "mixed":
        return [1] * 5 + [T - 8] + [1] * 3
    lens, left = [], T
    while left:
        n = min(left, rng.randint(1, max(1, T // 3)))
        lens.append(n)
        left -= n
    return lens


@dataclass
class Case:
    x: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    scalings: torch.Tensor
    out: torch.Tensor
    offsets: tuple[int, ...]
    info: LoRABatchInfo
    ranks: list[int]
    token_slots: list[int]

    @property
    def weights(self) -> LoRAWeights:
        return LoRAWeights(self.A, self.B, self.scalings, self.offsets)


def make_case(
    T: int,
    in_f: int,
    widths: tuple[int, ...],
    R: int,
    ranks: list[int],
    pattern: str,
    mode: str,
    dtype: torch.dtype,
    seed: int = 0,
    spare_rows: int = 0,
    pad_value: float = 0.0,
    device: torch.device = DEV,
) -> Case:
    """A pool of len(ranks) slots of max rank R (padding filled with ``pad_value``) and one batch, on
    ``device``."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    S, n = len(ranks), len(widths)
    offsets = tuple([0] + [sum(widths[: i + 1]) for i in range(n)])
    A = torch.full((S, n * R, in_f), pad_value)
    B = torch.full((S, offsets[-1], R), pad_value)
    for s, r in enumerate(ranks):
        for i in range(n):
            A[s, i * R : i * R + r] = torch.randn(r, in_f, generator=g) / in_f**0.5
            B[s, offsets[i] : offsets[i + 1], :r] = torch.randn(widths[i], r, generator=g) / r**0.5
    scalings = torch.rand(S, n, generator=g) + 0.5
    lens = split_tokens(T, mode, rng)
    slots = slots_for(pattern, len(lens), S, rng)
    info = LoRABatchInfo(T + spare_rows + 4, S, device)
    for s, r in enumerate(ranks):
        info.set_slot_rank(s, r)
    info.fill(lens, slots)
    token_slots = [s for n_tok, s in zip(lens, slots) for _ in range(n_tok)]
    x = torch.randn(T + spare_rows, in_f, generator=g)
    out = torch.randn(T + spare_rows, offsets[-1], generator=g)
    to = dict(device=device, dtype=dtype)
    return Case(
        x.to(**to),
        A.to(**to),
        B.to(**to),
        scalings.to(device),
        out.to(**to),
        offsets,
        info,
        ranks,
        token_slots,
    )


def route_as_graph_runs(c: Case, slots: list[int]) -> None:
    """Re-route ``c`` as a decode graph's step: ``slots`` per row in the runs layout (runs of rows on one
    slot, base rows, as many segment entries as rows, the unused ones empty), rank bound 16."""
    info = LoRABatchInfo(c.info.max_tokens, len(c.ranks), c.x.device, max_lora_rank=16)
    for s, r in enumerate(c.ranks):
        info.set_slot_rank(s, r)
    info.fill_rows(slots, rank_bound=16, layout="runs", segments=len(slots))
    c.info, c.token_slots = info, slots


def reference(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, out after add_lora) in fp64 by a per-token, per-slice loop over the contract."""
    T, n = len(c.token_slots), len(c.offsets) - 1
    R = c.B.shape[2]
    x, A, B = c.x.double().cpu(), c.A.double().cpu(), c.B.double().cpu()
    out = c.out.double().cpu().clone()
    h = torch.zeros(T, n * R, dtype=torch.float64)
    for t, s in enumerate(c.token_slots):
        if s < 0:
            continue
        r = c.ranks[s]
        for i in range(n):
            lo, hi = c.offsets[i], c.offsets[i + 1]
            hi_ = x[t] @ A[s, i * R : i * R + r].T
            hi_ = hi_.to(c.x.dtype).double()  # h lives in x.dtype (as PEFT computes it)
            h[t, i * R : i * R + r] = hi_
            out[t, lo:hi] += (B[s, lo:hi, :r] @ hi_) * float(c.scalings[s, i])
    return h, out


def assert_out(c: Case, got: torch.Tensor, want: torch.Tensor, out0: torch.Tensor) -> None:
    atol, rtol = TOL[c.x.dtype]
    T = len(c.token_slots)
    got64 = got.double().cpu()
    assert torch.isfinite(got64).all()
    torch.testing.assert_close(got64[:T], want[:T], atol=atol, rtol=rtol)
    base = torch.tensor([s < 0 for s in c.token_slots] + [True] * (got.shape[0] - T))
    assert torch.equal(got[base].cpu(), out0[base].cpu()), "rows without an adapter were modified"


# (T, in, slice widths, R, ranks per slot, popularity, token split) at interpreter-friendly sizes.
CPU_CASES = {
    "decode-distinct-qkv": (7, 64, (64, 16, 16), 16, [16, 8, 4, 16, 2, 16, 8, 1], "distinct", "decode"),
    "decode-uniform-gateup": (3, 48, (48, 48), 8, [8, 8, 4], "uniform", "decode"),
    "decode-zipf-single": (133, 32, (40,), 8, [8, 1, 4, 8, 2], "zipf", "decode"),
    "decode-identical": (7, 96, (32,), 16, [16, 16], "identical", "decode"),
    "decode-basemix-qkv": (7, 64, (64, 16, 16), 16, [16, 4, 8], "base_mix", "decode"),
    "single-token": (1, 64, (64, 16, 16), 16, [16], "identical", "decode"),
    "prefill-uniform-qkv": (133, 64, (64, 16, 16), 16, [16, 8, 2, 16], "uniform", "prefill"),
    "prefill-basemix-gateup": (37, 64, (32, 48), 16, [3, 16, 7], "base_mix", "prefill"),
    "prefill-zipf-single": (7, 96, (96,), 16, [1, 16, 5], "zipf", "prefill"),
    "mixed-ranks-1-to-128": (13, 32, (32, 16, 16), 128, [1, 128, 64, 7, 33], "distinct", "prefill"),
    # decode rows and a chunk longer than SGMV's token tiles in one batch (its tile table)
    "mixed-step-qkv": (78, 32, (32, 16, 16), 16, [16, 8, 4, 1], "base_mix", "mixed"),
    # in_features a multiple of BGMV's split: its shrink runs the unmasked (EVEN_K) loop
    "decode-wide-in-qkv": (5, 1024, (32, 16, 16), 16, [16, 8, 4], "distinct", "decode"),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _dtype_grid() -> list:
    """fp32 on every case; fp16/bf16 on a few (the interpreter is slow), all of them on CUDA."""
    params = []
    for name in CPU_CASES:
        for dt in DTYPES:
            cheap = dt == torch.float32 or name in (
                "decode-distinct-qkv",
                "prefill-basemix-gateup",
                "mixed-ranks-1-to-128",
                "single-token",
            )
            marks = () if cheap or HAS_CUDA else (pytest.mark.skip(reason="interpreter: fp32 covers it"),)
            params.append(pytest.param(name, dt, id=f"{name}-{str(dt)[6:]}", marks=marks))
    return params


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,dtype", _dtype_grid())
def test_add_lora_matches_reference(backend: str, name: str, dtype: torch.dtype) -> None:
    c = make_case(*CPU_CASES[name], dtype=dtype, seed=sum(map(ord, name)), spare_rows=2)
    _, want = reference(c)
    out0 = c.out.clone()
    get_backend(backend).add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_writes_reach_the_next_call(backend: str, dtype: torch.dtype) -> None:
    """A backend may keep derived copies of the pool (torch-gather's CPU decode path keeps oneDNN-packed A
    and expand matrices): after the pool writes a slot in place, as a slot load does, the next call uses
    the new weights and scalings."""
    c = make_case(*CPU_CASES["decode-basemix-qkv"], dtype=dtype, seed=11)
    backend_ = get_backend(backend)
    out0, want = c.out.clone(), reference(c)[1]
    backend_.add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)
    other = make_case(*CPU_CASES["decode-basemix-qkv"], dtype=dtype, seed=12)  # same ranks, new weights
    slot = max(c.token_slots)  # a slot the batch uses
    for mine, new in ((c.A, other.A), (c.B, other.B), (c.scalings, other.scalings)):
        mine[slot].copy_(new[slot])  # the slot's new adapter
    c.out.copy_(out0)
    want = reference(c)[1]
    backend_.add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["decode-basemix-qkv", "prefill-basemix-gateup", "mixed-ranks-1-to-128"])
def test_shrink_then_expand(backend: str, name: str) -> None:
    """The two interface calls separately: h matches (zeros on base rows), and expand adds it."""
    c = make_case(*CPU_CASES[name], dtype=torch.float32, seed=7)
    want_h, want = reference(c)
    shrink, expand = SHRINK_EXPAND[backend]
    h = shrink(c.x, c.A, c.info)
    assert h.shape == want_h.shape and h.dtype == c.x.dtype
    torch.testing.assert_close(h.double().cpu(), want_h, atol=1e-5, rtol=1e-5)
    out0 = c.out.clone()
    expand(h, c.weights, c.info, c.out)
    assert_out(c, c.out, want, out0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["decode-distinct-qkv", "decode-basemix-qkv", "mixed-ranks-1-to-128"])
def test_torch_gather_small_cpu_batches_skip_rank_padding(name: str, dtype: torch.dtype) -> None:
    """torch-gather's CPU dense path (at most 64 tokens) multiplies only each slot's live rank rows: a
    rank-8 adapter in a rank-64 pool costs 8 rows. Padding poisoned with NaN must not reach the sum.
    On CPU on every machine: the path is CPU-only (a GPU's torch-gather reads the padded pool)."""
    c = make_case(*CPU_CASES[name], dtype=dtype, seed=3, pad_value=float("nan"), device=torch.device("cpu"))
    assert c.info.num_tokens <= 64
    _, want = reference(c)
    out0 = c.out.clone()
    get_backend("torch-gather").add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("name", ["decode-distinct-qkv", "prefill-uniform-qkv", "mixed-ranks-1-to-128"])
def test_rank_padding_is_never_read(backend: str, name: str) -> None:
    """Weights past each adapter's rank poisoned with NaN: none may reach the sum, not even times zero
    (the expands load B up to the rank rounded up to 16 for wide loads and drop the columns past the
    slot's rank with where()). More mixes in test_rank_buckets.py."""
    c = make_case(*CPU_CASES[name], dtype=torch.float32, seed=3, pad_value=float("nan"))
    _, want = reference(c)
    out0 = c.out.clone()
    get_backend(backend).add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("name", ["decode-distinct-qkv", "mixed-ranks-1-to-128", "decode-basemix-qkv"])
def test_bgmv_with_partials_reduced_before_the_expand(
    name: str, split_k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TUNING["reduce_partials"]: the split-K planes summed by torch into h before the expand (an A/B
    variant) gives the reference too, NaN padding included."""
    monkeypatch.setitem(triton_bgmv.TUNING, "reduce_partials", True)
    c = make_case(*CPU_CASES[name], dtype=torch.float32, seed=5, pad_value=float("nan"))
    _, want = reference(c)
    out0 = c.out.clone()
    backend = get_backend("triton-bgmv")
    monkeypatch.setattr(backend, "split_k", split_k)
    backend.add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)


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


@pytest.mark.parametrize(
    "name,picked", [("decode-basemix-qkv", "triton-bgmv"), ("prefill-uniform-qkv", "triton-sgmv")]
)
def test_auto_picks_bgmv_for_decode_and_sgmv_otherwise(name: str, picked: str) -> None:
    c = make_case(*CPU_CASES[name], dtype=torch.float32, seed=5)
    _, want = reference(c)
    out0 = c.out.clone()
    be = get_backend("triton-auto")
    assert be.pick(c.info).name == picked
    be.add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)


@pytest.mark.parametrize("backend", [*BACKENDS, "triton-auto"])
@pytest.mark.parametrize(
    "name,dtype",
    [("decode-basemix-qkv", torch.float32), ("mixed-ranks-1-to-128", torch.float32),
     ("prefill-basemix-gateup", torch.float32), ("decode-distinct-qkv", torch.bfloat16)],
)  # fmt: skip
@pytest.mark.parametrize("sgmv_side_min_tokens", [None, 1])
def test_start_lora_then_finish_matches_the_reference(
    backend: str, name: str, dtype: torch.dtype, sgmv_side_min_tokens: int | None, monkeypatch
) -> None:  # noqa: ANN001
    """The two phases the LoRA layer runs on two CUDA streams (the shrink beside the base GEMM, the
    expand after it): ``start_lora(x)(out)`` adds the same delta as ``add_lora``, with ``x`` overwritten
    between the phases (the finish must not read x again: on the GPU the main stream may reuse it).
    BGMV always splits; SGMV from ``TUNING["side_min_tokens"]`` tokens on (forced down to 1 here)."""
    if sgmv_side_min_tokens is not None:
        monkeypatch.setitem(triton_sgmv.TUNING, "side_min_tokens", sgmv_side_min_tokens)
    c = make_case(*CPU_CASES[name], dtype=dtype, seed=13, spare_rows=2)
    _, want = reference(c)
    out0 = c.out.clone()
    be = get_backend(backend)
    x = c.x.clone()
    finish = be.start_lora(x, c.weights, c.info)
    if be.splits_work(c.info):
        x.fill_(float("nan"))
    finish(c.out)
    assert_out(c, c.out, want, out0)
    kernel = be.pick(c.info).name if backend == "triton-auto" else backend
    least = triton_sgmv.TUNING["side_min_tokens"]
    sgmv_splits = least is not None and c.info.num_tokens >= least
    assert be.splits_work(c.info) == (
        kernel == "triton-bgmv" or (kernel in ("triton-sgmv", "triton-fused") and sgmv_splits)
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_lora_batch_leaves_out_unchanged(backend: str) -> None:
    c = make_case(*CPU_CASES["decode-basemix-qkv"][:5], "all_base", "decode", dtype=torch.float32)
    assert not c.info.has_lora
    out0 = c.out.clone()
    be = get_backend(backend)
    be.add_lora(c.out, c.x, c.weights, c.info)
    assert torch.equal(c.out, out0)
    shrink, expand = SHRINK_EXPAND[backend]
    h = shrink(c.x, c.A, c.info)
    assert h.shape == (7, c.A.shape[1]) and not h.any()
    expand(h, c.weights, c.info, c.out)
    assert torch.equal(c.out, out0)


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("name", ["decode-distinct-qkv", "prefill-basemix-gateup"])
def test_split_k_values_agree(backend: str, split_k: int, name: str) -> None:
    """Shrink's split of in_features (fp32 partial planes summed by expand) changes nothing."""
    c = make_case(*CPU_CASES[name], dtype=torch.bfloat16, seed=11)
    want_h, want = reference(c)
    out0 = c.out.clone()
    be = get_backend(backend)
    be.split_k = split_k
    be.add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)
    h = SHRINK_EXPAND[backend][0](c.x, c.A, c.info, split_k=split_k)
    torch.testing.assert_close(h.double().cpu(), want_h, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", TRITON)
def test_bad_inputs_raise_value_errors(backend: str) -> None:
    c = make_case(*CPU_CASES["decode-uniform-gateup"], dtype=torch.float32)
    be = get_backend(backend)
    add = be.add_lora
    with pytest.raises(ValueError, match="in_features"):
        add(c.out, c.x[:, :-1], c.weights, c.info)
    with pytest.raises(ValueError, match="dtype"):
        add(c.out, c.x.half(), c.weights, c.info)
    with pytest.raises(ValueError, match="contiguous"):
        add(c.out, c.x.t().contiguous().t(), c.weights, c.info)
    with pytest.raises(ValueError, match="slice_offsets"):
        add(c.out, c.x, replace(c.weights, slice_offsets=(0, 48, 90)), c.info)
    with pytest.raises(ValueError, match="scalings"):
        add(c.out, c.x, replace(c.weights, scalings=c.scalings.double()), c.info)
    with pytest.raises(ValueError, match="rows"):
        add(c.out[:1], c.x, c.weights, c.info)
    with pytest.raises(ValueError, match="columns"):
        SHRINK_EXPAND[backend][1](c.x.new_zeros(3, 5), c.weights, c.info, c.out)


# Mistral-7B projections on CUDA: (in, slice widths), ranks mixed up to R = 64.
GPU_SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("proj", list(GPU_SHAPES))
@pytest.mark.parametrize("T,mode,pattern", [(1, "decode", "distinct"), (32, "decode", "distinct"),
                                            (256, "decode", "zipf"), (77, "decode", "base_mix"),
                                            (1031, "prefill", "uniform"), (2048, "prefill", "base_mix"),
                                            (1064, "mixed", "uniform")])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_shapes_on_gpu(
    backend: str, proj: str, T: int, mode: str, pattern: str, dtype: torch.dtype
) -> None:
    in_f, widths = GPU_SHAPES[proj]
    ranks = [8, 16, 64, 16, 8, 64, 32, 1] * 4
    c = make_case(T, in_f, widths, 64, ranks, pattern, mode, dtype, seed=T)
    _, want = reference_fast(c)
    out0 = c.out.clone()
    get_backend(backend).add_lora(c.out, c.x, c.weights, c.info)
    assert_out(c, c.out, want, out0)


def reference_fast(c: Case) -> tuple[None, torch.Tensor]:
    """The same oracle as :func:`reference`, vectorised per slot (fp64 on the GPU) for real shapes."""
    n, R = len(c.offsets) - 1, c.B.shape[2]
    out = c.out.double().clone()
    slots = torch.tensor(c.token_slots, device=c.x.device)
    for s, r in enumerate(c.ranks):
        rows = (slots == s).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        for i in range(n):
            lo, hi = c.offsets[i], c.offsets[i + 1]
            h = (c.x[rows].double() @ c.A[s, i * R : i * R + r].double().T).to(c.x.dtype).double()
            out[rows, lo:hi] += (h @ c.B[s, lo:hi, :r].double().T) * float(c.scalings[s, i])
    return None, out.cpu()
