"""Adapter pools for kernel and backend tests: random weights up to each slot's rank, NaN past it (rank
padding must never be read, not even times zero)."""

from __future__ import annotations

import torch


def nan_padded_pool(
    ranks: list[int], R: int, widths: tuple[int, ...], in_f: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(A [S, n*R, in_f], B [S, out, R], scalings [S, n], slice offsets) of len(ranks) slots of pool rank
    R, fp32 on CPU, slot s holding random weights of rank ranks[s] and NaN past it."""
    g = torch.Generator().manual_seed(seed)
    S, n = len(ranks), len(widths)
    offs = tuple([0] + [sum(widths[: i + 1]) for i in range(n)])
    A = torch.full((S, n * R, in_f), float("nan"))
    B = torch.full((S, offs[-1], R), float("nan"))
    for s, r in enumerate(ranks):
        for i in range(n):
            A[s, i * R : i * R + r] = torch.randn(r, in_f, generator=g) / in_f**0.5
            B[s, offs[i] : offs[i + 1], :r] = torch.randn(widths[i], r, generator=g) / r**0.5
    scalings = torch.rand(S, n, generator=g) + 0.5
    return A, B, scalings, offs


def lora_reference_f64(base: torch.Tensor, x: torch.Tensor, w, info) -> torch.Tensor:  # noqa: ANN001
    """float64 ``base + lora(x)`` for a backend's batch (``w`` LoRAWeights, ``info`` LoRABatchInfo), rank
    and slice by slice, h rounded to x.dtype as PEFT keeps it; rows with slot -1 are ``base``."""
    ref = base.double().clone()
    R = w.B.shape[2]
    for t, slot in enumerate(info.token_slots.tolist()):
        if slot < 0:
            continue
        r = int(info.ranks[slot])
        for j, (lo, hi) in enumerate(zip(w.slice_offsets, w.slice_offsets[1:])):
            h = (x[t].double() @ w.A[slot, j * R : j * R + r].double().T).to(x.dtype).double()
            ref[t, lo:hi] += h @ w.B[slot, lo:hi, :r].double().T * float(w.scalings[slot, j])
    return ref


def assert_replays_match(chain, x0: torch.Tensor, new_input, reference, replays: int) -> None:  # noqa: ANN001
    """Capture ``chain(static)`` (a list of outputs) in a CUDA graph on a copy of ``x0``, then ``replays``
    times: new inputs (``new_input()``) into the static copy, a replay, and the captured outputs equal
    ``reference(static)`` bit for bit."""
    static = x0.clone()
    chain(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(static)
    for _ in range(replays):
        static.copy_(new_input())
        graph.replay()
        for a, b in zip(captured, reference(static)):
            assert torch.equal(a, b)
