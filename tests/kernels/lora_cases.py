"""LoRA kernel test cases and their oracle: a pool of slots of mixed ranks, one batch routed over it
(adapter popularity, decode / prefill / mixed token splits), and a plain fp64 per-token loop over the
backend contract in :mod:`mmlora.backends.base`: ``h = x @ A[slot, slice, :rank].T`` rounded to x.dtype, then
``out += h @ B[slot, slice, :, :rank].T * scaling``; rows with slot -1 stay bit-identical.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from mmlora.forward.lora import LoRABatchInfo, LoRAWeights

HAS_CUDA = torch.cuda.is_available()


DEV = torch.device("cuda" if HAS_CUDA else "cpu")


BACKENDS = ["torch-gather", "triton-sgmv", "triton-bgmv"]


TRITON = ["triton-sgmv", "triton-bgmv"]


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
