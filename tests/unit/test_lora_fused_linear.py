"""torch-gather's fused CPU decode path (``fused_linear``: the base matmul and the LoRA expand in one
oneDNN call) against a float64 oracle written from the contract in :mod:`mmlora.backends.base`: the
base ``x @ W.T + b`` plus, token by token, ``(x @ A[slot, slice, :rank].T) @ B[slot, slice, :, :rank].T
* scaling``. Rank padding is poisoned with NaN (it must never be read), rows go base-only, row counts
are not powers of two (the packed matmul pads them), and a slot written after the first call must be
seen by the next."""

from __future__ import annotations

import random

import pytest
import torch
from lora_pools import nan_padded_pool

from mmlora.backends import get_backend
from mmlora.backends.onednn import PACKED_MAX_ROWS, onednn_linear_available, packable_dtypes
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="torch built without oneDNN")
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (6e-2, 4e-2)}


def _pool(in_f: int, widths: tuple[int, ...], R: int, ranks: list[int], dtype: torch.dtype, seed: int):
    """A (NaN past each rank), B, scalings and slice offsets of a pool of len(ranks) slots."""
    A, B, scalings, offs = nan_padded_pool(ranks, R, widths, in_f, seed)
    return LoRAWeights(A.to(dtype), B.to(dtype), scalings, offs)


def _segments(lens: list[int], seg_slots: list[int], ranks: list[int]) -> tuple[list[int], LoRABatchInfo]:
    """(each token's slot, the batch info) of segments ``lens`` on ``seg_slots`` in a rank-8 pool."""
    slots = [s for n, s in zip(lens, seg_slots) for _ in range(n)]
    info = LoRABatchInfo(len(slots), len(ranks), "cpu", max_lora_rank=8)
    for s, r in enumerate(ranks):
        info.set_slot_rank(s, r)
    info.fill(lens, seg_slots)
    return slots, info


def _oracle(x, weight, bias, w: LoRAWeights, slots: list[int], ranks: list[int]) -> torch.Tensor:  # noqa: ANN001
    """float64: the base linear, then each token's own adapter slice by slice (h rounded to x.dtype)."""
    out = x.double() @ weight.double().T + (0.0 if bias is None else bias.double())
    R = w.B.shape[2]
    for t, s in enumerate(slots):
        if s < 0:
            continue
        r = ranks[s]
        for i in range(w.n_slices):
            lo, hi = w.slice_offsets[i], w.slice_offsets[i + 1]
            h = (x[t].double() @ w.A[s, i * R : i * R + r].double().T).to(x.dtype).double()
            out[t, lo:hi] += (w.B[s, lo:hi, :r].double() @ h) * float(w.scalings[s, i])
    return out


def _info(slots: list[int], ranks: list[int]) -> LoRABatchInfo:
    info = LoRABatchInfo(PACKED_MAX_ROWS + 8, len(ranks), "cpu", max_lora_rank=16)
    for s, r in enumerate(ranks):
        info.set_slot_rank(s, r)
    info.fill([1] * len(slots), slots)
    return info


# (rows, in, slice widths, pool rank, slot ranks, bias): qkv-, gate_up- and o-like modules.
CASES = {
    "qkv-16-rows": (16, 64, (64, 16, 16), 16, [8, 16, 4, 1], True),
    "gateup-13-rows": (13, 48, (96, 96), 8, [8, 2, 8], False),
    "o-one-row": (1, 40, (40,), 16, [16], False),
    "down-64-rows": (PACKED_MAX_ROWS, 96, (32,), 8, [8, 8, 8, 8, 4, 2, 1, 8], True),
}


@pytest.mark.parametrize("dtype", packable_dtypes())
@pytest.mark.parametrize("name", CASES)
def test_fused_linear_matches_the_float64_oracle(name: str, dtype: torch.dtype) -> None:
    rows, in_f, widths, R, ranks, with_bias = CASES[name]
    rng = random.Random(name)
    slots = [rng.randrange(-1, len(ranks)) for _ in range(rows)]
    slots[0] = 0  # at least one adapter row, and (below) one base row where there is room
    if rows > 1:
        slots[-1] = -1
    w = _pool(in_f, widths, R, ranks, dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    weight = (torch.randn(sum(widths), in_f, generator=g) / in_f**0.5).to(dtype)
    bias = torch.randn(sum(widths), generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    info = _info(slots, ranks)
    with torch.inference_mode():
        got = get_backend("torch-gather").fused_linear(x, weight, bias, w, info)
    assert got is not None and got.shape == (rows, sum(widths)) and got.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.double(), _oracle(x, weight, bias, w, slots, ranks), atol=atol, rtol=rtol)


def test_fused_linear_sees_a_slot_written_after_its_first_call() -> None:
    """The fused weights are cached per module; a slot load (an in-place write into A, B or the
    scalings) or a new base weight must rebuild them."""
    ranks = [8, 4]
    w = _pool(32, (24, 8), 8, ranks, torch.float32, seed=3)
    weight = torch.randn(32, 32) / 32**0.5
    x = torch.randn(5, 32)
    slots = [0, 1, -1, 1, 0]
    backend = get_backend("torch-gather")

    def check() -> None:
        got = backend.fused_linear(x, weight, None, w, _info(slots, ranks))
        torch.testing.assert_close(
            got.double(), _oracle(x, weight, None, w, slots, ranks), atol=1e-4, rtol=1e-4
        )

    with torch.no_grad():
        check()
        w.A[1, :4] = torch.randn(4, 32)
        w.B[0, :, :8] = torch.randn(32, 8)
        w.scalings[1, 0] = 3.0
        check()
        weight.mul_(2)  # the base weight alone (reloaded weights)
        check()


def test_fused_linear_declines_what_it_does_not_fuse() -> None:
    """None (the layer then runs base + add_lora) for a prefill past PACKED_MAX_ROWS tokens of one
    adapter (one segment: the segment path is exact and as few calls), where autograd records x
    or the weight (as PackedLinear), for a float64 batch and for an inference-mode weight (no version
    counter to notice writes by)."""
    backend = get_backend("torch-gather")
    w = _pool(16, (16,), 8, [8], torch.float32, seed=4)
    weight = torch.randn(16, 16)
    many = PACKED_MAX_ROWS + 1
    assert backend.fused_linear(torch.randn(many, 16), weight, None, w, _info([0] * many, [8])) is None
    x = torch.randn(3, 16, requires_grad=True)
    assert backend.fused_linear(x, weight, None, w, _info([0] * 3, [8])) is None
    trained = torch.nn.Parameter(weight.clone())
    assert backend.fused_linear(torch.randn(3, 16), trained, None, w, _info([0] * 3, [8])) is None
    with torch.no_grad():  # the same weight with autograd off fuses
        assert backend.fused_linear(torch.randn(3, 16), trained, None, w, _info([0] * 3, [8])) is not None
    w64 = LoRAWeights(w.A.double(), w.B.double(), w.scalings, w.slice_offsets)
    assert (
        backend.fused_linear(torch.randn(3, 16).double(), weight.double(), None, w64, _info([0] * 3, [8]))
        is None
    )
    with torch.inference_mode():
        frozen = torch.randn(16, 16)
        assert backend.fused_linear(torch.randn(3, 16), frozen, None, w, _info([0] * 3, [8])) is None


@pytest.mark.parametrize("widths", [(48, 16, 16), (40,)])
def test_prefill_of_many_prompts_on_few_adapters_groups_rows_by_slot(widths: tuple[int, ...]) -> None:
    """A CPU prefill whose adapter segments outnumber their slots (here 12 prompts on 3 adapters and the
    base, past PACKED_MAX_ROWS tokens) runs one gathered matmul per slot: the same sums as the oracle,
    base-only rows bit-identical."""
    ranks = [8, 4, 2]
    w = _pool(48, widths, 8, ranks, torch.float32, seed=6)
    w = LoRAWeights(
        torch.nan_to_num(w.A), torch.nan_to_num(w.B), w.scalings, w.slice_offsets
    )  # the grouped path multiplies the zero rank padding
    lens = [5, 9, 7, 3, 11, 6, 8, 2, 10, 4, 7, 9]
    seg_slots = [0, 1, -1, 2, 0, 1, 2, -1, 0, 2, 1, 0]
    slots, info = _segments(lens, seg_slots, ranks)
    assert len(slots) > PACKED_MAX_ROWS
    g = torch.Generator().manual_seed(7)
    x = torch.randn(len(slots), 48, generator=g)
    weight = torch.randn(sum(widths), 48, generator=g) / 48**0.5
    out = x @ weight.T
    out0 = out.clone()
    with torch.inference_mode():
        get_backend("torch-gather").add_lora(out, x, w, info)
    torch.testing.assert_close(out.double(), _oracle(x, weight, None, w, slots, ranks), atol=1e-4, rtol=1e-4)
    base = torch.tensor([s < 0 for s in slots])
    assert torch.equal(out[base], out0[base])


def test_a_prefill_of_many_prompts_on_few_adapters_fuses_in_pieces() -> None:
    """Past PACKED_MAX_ROWS tokens, adapter segments outnumbering their slots: 64-row pieces (the last
    padded), against the oracle; a module whose live rank rows exceed a quarter of its input width
    declines (every row would multiply every slot's rank rows)."""
    ranks = [8, 4, 2]
    w = _pool(192, (48, 16, 16), 8, ranks, torch.float32, seed=8)  # 42 live rows <= 192 / 4
    lens = [9, 14, 7, 12, 11, 6, 13, 10, 8, 15, 9, 16]  # 130 tokens: pieces of 64, 64 and 2 (padded to 2)
    seg_slots = [0, 1, -1, 2, 0, 1, 2, -1, 0, 2, 1, 0]
    slots, info = _segments(lens, seg_slots, ranks)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(len(slots), 192, generator=g)
    weight = torch.randn(80, 192, generator=g) / 192**0.5
    bias = torch.randn(80, generator=g)
    backend = get_backend("torch-gather")
    with torch.inference_mode():
        got = backend.fused_linear(x, weight, bias, w, info)
    assert got is not None and got.shape == (len(slots), 80)
    torch.testing.assert_close(got.double(), _oracle(x, weight, bias, w, slots, ranks), atol=1e-4, rtol=1e-4)
    narrow = _pool(40, (48, 16, 16), 8, ranks, torch.float32, seed=8)  # 42 live rows > 40 / 4
    info.fill(lens, seg_slots)
    with torch.inference_mode():
        assert (
            backend.fused_linear(torch.randn(len(slots), 40), torch.randn(80, 40), None, narrow, info) is None
        )


def test_engine_uses_the_fused_path_only_when_opted_in(tmp_path) -> None:  # noqa: ANN001
    """``cpu_fused_lora`` (off by default: it keeps a second copy of the weights) routes an engine's CPU
    LoRA modules through ``fused_linear``; mixed-adapter greedy tokens equal the unfused engine's (which
    the HF + PEFT tests hold to PEFT)."""
    from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint

    import mmlora

    base = make_checkpoint(tmp_path / "base", "llama")
    adapters = {
        f"a{i}": str(
            make_adapter(base, tmp_path / f"a{i}", seed=i, r=4, lora_alpha=8, target_modules=ALL_SEVEN)
        )
        for i in range(3)
    }
    prompts, loras = ["Hello world", "The cat", "One two three", "Why"], ["a0", None, "a1", "a2"]
    greedy = {"temperature": 0.0, "max_new_tokens": 8}
    runs = {}
    for fused in (False, True):
        eng = mmlora.Engine(
            model=str(base), lora_paths=adapters, device="cpu", dtype="float32", cpu_fused_lora=fused
        )
        runs[fused] = [o.output_ids for o in eng.generate(prompts, loras, sampling_params=greedy)]
        assert bool(eng.lora._ctx.backend._fused_cache) == fused
    assert runs[True] == runs[False]
