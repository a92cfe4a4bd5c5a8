"""The per-row C LoRA (:mod:`mmlora.backends.cpu_row_lora`) against float64 references written from its
docstrings, on unpaged and paged pools; and torch-gather's CPU routing to it. Skipped where the C kernels
are not built."""

from __future__ import annotations

import pytest
import torch

from mmlora.backends import cpu_kernels, cpu_plan, cpu_row_lora, get_backend
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights, page_weights

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels are not built here")
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _pool(
    S: int, R: int, in_f: int, widths: tuple[int, ...], ranks: list[int], seed: int, pad: float = float("nan")
) -> LoRAWeights:
    """An unpaged fp32 pool whose ranks past each slot's own hold ``pad`` (NaN: a kernel that reads them
    fails; a pool holds zeros there, which the torch paths multiply)."""
    g = torch.Generator().manual_seed(seed)
    n, out = len(widths), sum(widths)
    A = torch.randn(S, n, R, in_f, generator=g)
    B = torch.randn(S, out, R, generator=g)
    for s, r in enumerate(ranks):
        A[s, :, r:] = pad
        B[s, :, r:] = pad
    offs = [0]
    for w in widths:
        offs.append(offs[-1] + w)
    scalings = torch.rand(S, n, generator=g) + 0.5
    return LoRAWeights(A.view(S, n * R, in_f), B, scalings, tuple(offs))


def _shrink_ref(x, w: LoRAWeights, slots: list[int], ranks: list[int]) -> torch.Tensor:  # noqa: ANN001
    S, nR, in_f = w.A.shape
    n = w.n_slices
    A = w.A.view(S, n, nR // n, in_f).double()
    h = torch.zeros(x.shape[0], n, nR // n, dtype=torch.float64)
    for t, s in enumerate(slots):
        if s >= 0:
            r = ranks[s]
            h[t, :, :r] = A[s, :, :r] @ x[t].double()
    return h.view(x.shape[0], nR)


def _expand_ref(y, h, w: LoRAWeights, slots: list[int], ranks: list[int]) -> torch.Tensor:  # noqa: ANN001
    out, offs, n = y.double().clone(), w.slice_offsets, w.n_slices
    R = h.shape[1] // n
    for t, s in enumerate(slots):
        if s < 0 or ranks[s] == 0:
            continue
        r = ranks[s]
        for i in range(n):
            lo, hi = offs[i], offs[i + 1]
            delta = (h[t, i * R : i * R + r].double() @ w.B[s, lo:hi, :r].T.double()) * float(
                w.scalings[s, i]
            )
            out[t, lo:hi] += delta.to(y.dtype).double() if y.dtype != torch.float32 else delta
    return out


def _in_dtype(w: LoRAWeights, dtype: torch.dtype) -> LoRAWeights:
    return LoRAWeights(w.A.to(dtype), w.B.to(dtype), w.scalings, w.slice_offsets)


@pytest.mark.parametrize("dtype", cpu_row_lora.ROW_DTYPES)
@pytest.mark.parametrize(("R", "page_rank"), [(8, None), (8, 4), (16, None), (32, 16), (64, None)])
@pytest.mark.parametrize(
    ("rows", "in_f", "widths", "units"),
    [
        (16, 64, (64, 32, 32), [8, 3, 0, 1, 5, 8, 2, 4, 6]),  # qkv-like, mixed ranks, an empty slot
        (7, 37, (29,), [8, 8, 8]),  # odd sizes: a tail in both loops
        (33, 96, (40, 40), [7, 1, 8, 2, 6, 5, 3, 4, 8, 8, 8, 8]),
        (40, 48, (24,), [8, 5]),  # many rows a slot: several full groups of rows each
    ],
)
def test_shrink_and_expand_match_float64(rows, in_f, widths, units, R, page_rank, dtype) -> None:  # noqa: ANN001
    """Rows over many slots (repeats, base-only rows), ranks in eighths of the pool rank R (some odd, some
    across pages and vectors); the ranks past each slot's own are NaN, so only a kernel that reads each
    slot's own ranks passes. Paged: the same pool in pages of ``page_rank`` ranks. The pool ranks cover the
    expand's builds for a page rank of 16, 32, 64 and any other."""
    ranks = [min(R, u * R // 8 + (u % 3 == 1)) for u in units]
    S = len(ranks)
    ref = _pool(S, R, in_f, widths, ranks, seed=rows)
    live = [s for s, r in enumerate(ranks) if r]
    slots = [-1 if t % 5 == 3 else live[(7 * t) % len(live)] for t in range(rows)]
    slots[0] = ranks.index(0) if 0 in ranks else slots[0]  # a row on an empty slot: base-only
    token_slots = torch.tensor([*slots, 5, 5], dtype=torch.int32)  # past T: ignored
    rank_t = torch.tensor(ranks, dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, in_f + 3, generator=g)[:, :in_f].to(dtype)  # strided rows
    w = _in_dtype(ref, dtype)
    pool = w if page_rank is None else page_weights(w, page_rank)
    h = cpu_row_lora.lora_row_shrink(x, pool.A, pool.n_slices, token_slots, rank_t)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(
        h.double(), _shrink_ref(x, _in_dtype(w, torch.float32), slots, ranks), atol=atol, rtol=rtol
    )
    y = torch.randn(rows, sum(widths) + 5, generator=g).to(dtype)[:, 2 : 2 + sum(widths)]
    want = _expand_ref(y, h, w, slots, ranks)
    cpu_row_lora.lora_row_expand(y, h, pool.B, pool.scalings, pool.slice_offsets, token_slots, rank_t)
    torch.testing.assert_close(y.double(), want, atol=atol, rtol=rtol)


def test_the_kernels_refuse_mismatched_tensors() -> None:
    w = _pool(2, 4, 16, (8,), [4, 4], seed=0)
    slots, ranks = torch.zeros(3, dtype=torch.int32), torch.full((2,), 4, dtype=torch.int32)
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="dtypes"):
        cpu_row_lora.lora_row_shrink(x.double(), w.A, 1, slots, ranks)
    with pytest.raises(ValueError, match="token_slots"):
        cpu_row_lora.lora_row_shrink(x, w.A, 1, slots.long(), ranks)
    h = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="scalings"):
        cpu_row_lora.lora_row_expand(torch.zeros(3, 8), h, w.B, w.scalings.double(), (0, 8), slots, ranks)


def _batch(S: int, slots: list[int], ranks: list[int], layout: str | None) -> LoRABatchInfo:
    info = LoRABatchInfo(256, S, "cpu", max_lora_rank=8)
    for s, r in enumerate(ranks):
        info.set_slot_rank(s, r)
    if layout is None:
        info.fill([1] * len(slots), slots)
    else:
        info.fill_rows(slots, info.bound_of(slots), layout)
    return info


@pytest.mark.parametrize("dtype", cpu_row_lora.ROW_DTYPES)
def test_torch_gather_routes_many_slot_decode_steps_to_the_kernels(monkeypatch, dtype) -> None:  # noqa: ANN001
    """16 slots (more than the dense path takes): a decode step runs the kernels, with the by-slot torch
    path's result, and records into a CPU plan that replays another mix of adapters right; a prefill-like
    batch (many rows a slot) keeps the by-slot path, as does everything with the flag off."""
    S, ranks = 16, [8, 4, 2, 8, 1, 8, 6, 3] * 2
    w = _in_dtype(_pool(S, 8, 48, (48, 16, 16), ranks, seed=3, pad=0.0), dtype)
    backend, g = get_backend("torch-gather"), torch.Generator().manual_seed(2)
    x = torch.randn(12, 48, generator=g).to(dtype)
    slots = [s if s % 4 else -1 for s in range(12)]
    calls = []
    real = cpu_row_lora.add_lora_rows
    monkeypatch.setattr(cpu_row_lora, "add_lora_rows", lambda *a: calls.append(1) or real(*a))

    def run(info: LoRABatchInfo, enabled: bool, x: torch.Tensor = x) -> torch.Tensor:
        monkeypatch.setattr(cpu_row_lora, "ENABLED", enabled)
        out = torch.zeros(x.shape[0], 80).to(dtype)
        backend.add_lora(out, x, w, info)
        return out

    info = _batch(S, slots, ranks, "rows")
    want = run(info, False)
    assert calls == []
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(run(info, True), want, atol=atol, rtol=rtol)
    assert calls == [1]
    out = torch.zeros(x.shape[0], 80).to(dtype)
    _, plan, reason = cpu_plan.capture(lambda: backend.add_lora(out, x, w, info))
    assert plan is not None, reason
    other = [(5 * s + 1) % S for s in range(12)]
    out.zero_()
    info.fill_rows(other, info.bound_of(other), "rows")
    plan.replay()
    torch.testing.assert_close(out, run(_batch(S, other, ranks, "rows"), False), atol=atol, rtol=rtol)
    calls.clear()
    prefill = _batch(S, [1] * 80 + [2] * 80, ranks, None)  # 80 rows a slot: one matmul beats per-row dots
    run(prefill, True, torch.randn(160, 48, generator=g).to(dtype))
    assert calls == []


@pytest.fixture(scope="module")
def ten_adapters(tmp_path_factory):  # noqa: ANN001, ANN201
    from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint

    root = tmp_path_factory.mktemp("row_lora")
    base = make_checkpoint(root / "base", "llama")
    adapters = {
        f"a{i}": make_adapter(
            base, root / f"a{i}", seed=i, r=1 + i % 4, lora_alpha=8, target_modules=ALL_SEVEN
        )
        for i in range(10)
    }
    return base, adapters


def test_an_engine_over_many_slots_replays_its_decode_steps(ten_adapters, monkeypatch) -> None:  # noqa: ANN001
    """16 slots, 12 rows on 10 distinct adapters and the base: the steps the by-slot torch path ran eagerly
    (a refused plan) now replay from plans, with its tokens and its logprobs within fp32 rounding; and a
    replay gives the eager per-row steps' logprobs exactly."""
    import mmlora

    base, adapters = ten_adapters
    prompts = [f"prompt {i} " + "x " * (i % 5) for i in range(12)]
    loras = [None if i in (3, 8) else f"a{i % 10}" for i in range(12)]
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}

    def run(row_path: bool, plans: bool) -> tuple[list, mmlora.Engine]:
        monkeypatch.setattr(cpu_row_lora, "ENABLED", row_path)
        engine = mmlora.Engine(
            model=str(base), lora_paths={k: str(v) for k, v in adapters.items()}, device="cpu",
            max_loras_per_batch=16, max_lora_rank=4, max_kv_tokens=512, dtype="float32",
            disable_cpu_graph=not plans,
        )  # fmt: skip
        outs = engine.generate(prompts, lora_paths=loras, sampling_params=greedy, return_logprob=True)
        return [(o.output_ids, o.logprobs) for o in outs], engine

    before, old = run(False, True)
    assert old.runner.decode_graphs.num_plan_replays == 0  # the by-slot path refuses every capture
    after, engine = run(True, True)
    graphs = engine.runner.decode_graphs
    assert graphs.num_plan_replays >= 3 and not graphs._refused
    assert [ids for ids, _ in after] == [ids for ids, _ in before]
    for (_, lp_after), (_, lp_before) in zip(after, before):
        torch.testing.assert_close(lp_after, lp_before, atol=1e-4, rtol=0)
    eager, _ = run(True, False)
    assert after == eager
