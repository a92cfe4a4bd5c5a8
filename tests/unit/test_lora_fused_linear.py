"""torch-gather's fused CPU path (``fused_linear``: the base matmul and every slot's LoRA shrink in one
oneDNN call over the stacked ``[W; A_live]``, then the expand) against a float64 oracle written from
the contract in :mod:`mmlora.backends.base`: the base ``x @ W.T + b`` plus, token by token,
``(x @ A[slot, slice, :rank].T) @ B[slot, slice, :, :rank].T * scaling``. Rank padding is poisoned with
NaN (it must never be read), rows go base-only, row counts are not powers of two (the packed matmul pads
them), and a slot written after the first call must be seen by the next."""

from __future__ import annotations

import random

import pytest
import torch
from lora_pools import nan_padded_pool

from mmlora.backends import cpu_kernels, get_backend
from mmlora.backends.cpu_dense import STACK_SHARE
from mmlora.backends.onednn import PACKED_MAX_ROWS, onednn_linear_available, packable_dtypes
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights
from mmlora.layers.packed_linear import PackedLinear

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


# (rows, in, slice widths, pool rank, slot ranks, bias): qkv-, gate_up-, o- and down-like modules, each
# with live rank rows (slices x the sum of the ranks) at most STACK_SHARE of its output width.
CASES = {
    "qkv-16-rows": (16, 64, (256, 64, 64), 16, [8, 16, 4, 1], True),
    "gateup-13-rows": (13, 48, (96, 96), 8, [8, 2, 8], False),
    "o-one-row": (1, 40, (80,), 16, [16], False),
    "down-64-rows": (PACKED_MAX_ROWS, 96, (192,), 8, [8, 8, 8, 8, 4, 2, 1, 8], True),
}


@pytest.mark.parametrize("c_kernels", [True, False], ids=["c-expand", "torch-expand"])
@pytest.mark.parametrize("dtype", packable_dtypes())
@pytest.mark.parametrize("name", CASES)
def test_fused_linear_matches_the_float64_oracle(
    name: str, dtype: torch.dtype, c_kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both expands: the C kernel's (where it is built here) and the torch path's (mask, packed matmul)."""
    if c_kernels and not cpu_kernels.available():
        pytest.skip("the C kernels are not built here")
    monkeypatch.setattr(cpu_kernels, "ENABLED", c_kernels)
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


def test_a_batch_without_adapter_rows_gets_the_base_columns() -> None:
    """Base-only rows (and a forward outside the LoRA manager, ``info`` None, once the module's stacked
    weights exist) read the first ``out`` columns of the stacked matmul: the base linear alone."""
    ranks = [8, 4]
    w = _pool(32, (64, 32), 8, ranks, torch.float32, seed=5)
    g = torch.Generator().manual_seed(5)
    weight, bias, x = (
        torch.randn(96, 32, generator=g) / 32**0.5,
        torch.randn(96, generator=g),
        torch.randn(7, 32),
    )
    backend = get_backend("torch-gather")
    base = _oracle(x, weight, bias, w, [-1] * 7, ranks)
    with torch.no_grad():
        assert backend.fused_linear(x, weight, bias, w, None) is None  # nothing stacked yet
        got = backend.fused_linear(x, weight, bias, w, _info([-1] * 7, ranks))
        torch.testing.assert_close(got.double(), base, atol=1e-4, rtol=1e-4)
        assert got.shape == (7, 96)
        torch.testing.assert_close(
            backend.fused_linear(x, weight, bias, w, None).double(), base, atol=1e-4, rtol=1e-4
        )


def test_fused_linear_sees_a_slot_written_after_its_first_call() -> None:
    """The stacked weights are cached per module; a slot load (an in-place write into A, B or the
    scalings) or a new base weight or bias must rebuild them."""
    ranks = [8, 4]
    w = _pool(32, (64, 32), 8, ranks, torch.float32, seed=3)
    weight = torch.randn(96, 32) / 32**0.5
    bias = torch.randn(96)
    x = torch.randn(5, 32)
    slots = [0, 1, -1, 1, 0]
    backend = get_backend("torch-gather")

    def check() -> None:
        got = backend.fused_linear(x, weight, bias, w, _info(slots, ranks))
        torch.testing.assert_close(
            got.double(), _oracle(x, weight, bias, w, slots, ranks), atol=1e-4, rtol=1e-4
        )

    with torch.no_grad():
        check()
        w.A[1, :4] = torch.randn(4, 32)
        w.B[0, :, :8] = torch.randn(96, 8)
        w.scalings[1, 0] = 3.0
        check()
        weight.mul_(2)  # the base weight alone (reloaded weights)
        check()
        bias.add_(1.0)
        check()


def test_fused_linear_declines_what_it_does_not_fuse() -> None:
    """None (the layer then runs base + add_lora) where autograd records x or the weight (as
    PackedLinear), for a float64 batch, for an inference-mode weight (no version counter to notice
    writes by) and where the live rank rows exceed STACK_SHARE of the output width (a batch without
    adapter rows would pay for them)."""
    backend = get_backend("torch-gather")
    w = _pool(16, (64,), 8, [8], torch.float32, seed=4)
    weight = torch.randn(64, 16)
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
        frozen = torch.randn(64, 16)
        assert backend.fused_linear(torch.randn(3, 16), frozen, None, w, _info([0] * 3, [8])) is None
    narrow = _pool(16, (16,), 8, [8], torch.float32, seed=4)  # 8 live rows > 16 * STACK_SHARE
    assert STACK_SHARE * 16 < 8
    with torch.no_grad():
        assert (
            backend.fused_linear(torch.randn(3, 16), torch.randn(16, 16), None, narrow, _info([0] * 3, [8]))
            is None
        )


def test_a_long_prefill_of_one_adapter_fuses_in_pieces() -> None:
    """Past PACKED_MAX_ROWS tokens of one adapter (one segment): the stacked matmul over every row (in
    pieces on oneDNN), the delta
    through the exact segment path; against the oracle."""
    ranks = [8]
    w = _pool(24, (48,), 8, ranks, torch.float32, seed=10)
    many = PACKED_MAX_ROWS + 7
    slots, info = _segments([many], [0], ranks)
    g = torch.Generator().manual_seed(10)
    x, weight = torch.randn(many, 24, generator=g), torch.randn(48, 24, generator=g) / 24**0.5
    with torch.no_grad():
        got = get_backend("torch-gather").fused_linear(x, weight, None, w, info)
    assert got is not None and got.shape == (many, 48)
    torch.testing.assert_close(got.double(), _oracle(x, weight, None, w, slots, ranks), atol=1e-4, rtol=1e-4)


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
    padded) with a dense expand, against the oracle; where the live rank rows exceed a quarter of the
    input width (every row would multiply every slot's rank rows) the per-slot path adds the delta."""
    ranks = [8, 4, 2]
    lens = [9, 14, 7, 12, 11, 6, 13, 10, 8, 15, 9, 16]  # 130 tokens: pieces of 64, 64 and 2 (padded to 2)
    seg_slots = [0, 1, -1, 2, 0, 1, 2, -1, 0, 2, 1, 0]
    slots, info = _segments(lens, seg_slots, ranks)
    backend = get_backend("torch-gather")
    for in_f in (192, 40):  # 42 live rows <= 192 / 4; > 40 / 4
        w = _pool(in_f, (128, 32, 32), 8, ranks, torch.float32, seed=8)
        if in_f == 40:  # the per-slot path multiplies the rank padding (zeros in an engine's pool)
            w = LoRAWeights(torch.nan_to_num(w.A), torch.nan_to_num(w.B), w.scalings, w.slice_offsets)
        g = torch.Generator().manual_seed(9)
        x = torch.randn(len(slots), in_f, generator=g)
        weight = torch.randn(192, in_f, generator=g) / in_f**0.5
        bias = torch.randn(192, generator=g)
        info.fill(lens, seg_slots)
        with torch.inference_mode():
            got = backend.fused_linear(x, weight, bias, w, info)
        assert got is not None and got.shape == (len(slots), 192)
        torch.testing.assert_close(
            got.double(), _oracle(x, weight, bias, w, slots, ranks), atol=1e-4, rtol=1e-4
        )


def test_packed_linear_packs_again_after_a_release() -> None:
    """A released PackedLinear (its stacked stand-in declined) packs itself again on its next call."""
    layer = PackedLinear(16, 8)
    assert layer.prepack()
    layer.release()
    assert not layer.is_packed
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert layer.is_packed


def test_engine_fuses_by_default_and_keeps_one_packed_weight(tmp_path) -> None:  # noqa: ANN001
    """``cpu_fused_lora`` (on by default) routes an engine's CPU LoRA modules through ``fused_linear``
    and frees the base layers' own packed copies (the stacked ones stand in); mixed-adapter greedy
    tokens equal those of the engine without it (which the HF + PEFT tests hold to PEFT)."""
    from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint

    import mmlora
    from mmlora.lora.layer import LoRALinear

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
    for fused in (True, False):
        kwargs = {} if fused else {"cpu_fused_lora": False}
        eng = mmlora.Engine(
            model=str(base), lora_paths=adapters, device="cpu", dtype="float32", max_lora_rank=4, **kwargs
        )
        runs[fused] = [o.output_ids for o in eng.generate(prompts, loras, sampling_params=greedy)]
        wrapped = [m for m in eng.model.modules() if isinstance(m, LoRALinear)]
        stacked = eng.lora._ctx.backend._fused_cache
        assert bool(stacked) == fused
        # One packed weight per module: the stacked one, or the base's own where the module declined
        # (the tiny model's narrow modules have more live rank rows than STACK_SHARE of their width).
        assert all((m.weights.B.data_ptr() in stacked) != m.base.is_packed for m in wrapped)
    assert runs[True] == runs[False]
