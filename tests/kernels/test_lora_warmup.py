"""The LoRA kernel warm-up compiles the variants a serving step can launch (issue 23: no Triton compile
inside a timed run). On CUDA: after the warm-up, random batches of every kind (decode, prefill,
mixed steps; mixed ranks; base rows) compile nothing, gate_up's deferred expand included, counted through
Triton's post-compile hook."""

from __future__ import annotations

import random

import pytest
import torch

from mmlora.backends import get_backend
from mmlora.backends.base import LoRABackend
from mmlora.backends.warmup import LAYOUTS, warm_up_lora_kernels
from mmlora.forward import LoRABatchInfo, LoRAWeights

HAS_CUDA = torch.cuda.is_available()

# Mistral-7B-like module shapes, scaled down: (in, slice widths).
SHAPES = [(256, (256, 64, 64)), (256, (512, 512)), (512, (256,))]


def pool(device: torch.device, slots: int, R: int) -> list[LoRAWeights]:
    g = torch.Generator().manual_seed(0)
    weights = []
    for in_f, widths in SHAPES:
        offs = tuple([0] + [sum(widths[: i + 1]) for i in range(len(widths))])
        A = (torch.randn(slots, len(widths) * R, in_f, generator=g) / 16).to(device, torch.bfloat16)
        B = (torch.randn(slots, offs[-1], R, generator=g) / 4).to(device, torch.bfloat16)
        weights.append(LoRAWeights(A, B, torch.ones(slots, len(widths), device=device), offs))
    return weights * 2  # two "layers" of each shape: warmed once per distinct shape


def test_warm_up_runs_each_layout_once_per_distinct_shape_and_rank_bucket() -> None:
    weights = pool(torch.device("cpu"), 3, 8)
    calls = warm_up_lora_kernels(get_backend("torch-gather"), weights, max_tokens=4096)
    assert calls == len(SHAPES) * len(LAYOUTS)  # a rank-8 pool has one bucket
    fitting = sum(sum(lens) <= 2 for lens in LAYOUTS)
    assert warm_up_lora_kernels(get_backend("torch-gather"), weights, max_tokens=2) == len(SHAPES) * fitting
    seen: list[int] = []

    class Recording(LoRABackend):
        def add_lora(self, out, x, w, info) -> None:  # noqa: ANN001
            seen.append(info.rank_bound)

    calls = warm_up_lora_kernels(Recording(), pool(torch.device("cpu"), 3, 64), max_tokens=4096)
    assert calls == len(SHAPES) * len(LAYOUTS) * 3
    assert sorted(set(seen)) == [16, 32, 64]  # every bound a batch of a rank-64 pool can have


@pytest.mark.parametrize("own_variants", [False, True])
def test_warm_up_runs_add_lora_after_base_only_where_it_launches_variants_of_its_own(
    own_variants: bool,
) -> None:
    after: list[int] = []

    class Recording(LoRABackend):
        def add_lora(self, out, x, w, info) -> None:  # noqa: ANN001
            pass

        def add_lora_after_base(self, out, x, w, info) -> None:  # noqa: ANN001
            after.append(info.rank_bound)

        def launches_after_base(self) -> bool:
            return own_variants

    calls = warm_up_lora_kernels(Recording(), pool(torch.device("cpu"), 3, 64), max_tokens=4096)
    assert len(after) == (calls if own_variants else 0)


@pytest.mark.parametrize("shrink_pdl", [False, True])
def test_sgmv_and_auto_launch_variants_after_the_base_gemm_only_with_shrink_pdl(
    shrink_pdl: bool, monkeypatch
) -> None:  # noqa: ANN001
    from mmlora.backends import triton_sgmv

    monkeypatch.setitem(triton_sgmv.TUNING, "shrink_pdl", shrink_pdl)
    for name in ("triton-sgmv", "triton-auto"):
        assert get_backend(name).launches_after_base() is shrink_pdl
    assert not get_backend("triton-bgmv").launches_after_base()


@pytest.mark.parametrize("backend", ["triton-sgmv", "triton-auto"])
def test_warm_up_launches_every_expand_group_the_rule_may_pick(backend: str, monkeypatch) -> None:
    """SGMV's decode-run expand takes its column-tile group (a compile-time constant) from the batch's program
    count (``run_expand_group_programs``), so the warm-up's small batches launch groups 4, 2 and 1 as well,
    and leave TUNING as they found it."""
    from mmlora.backends import triton_sgmv

    groups: set[int] = set()
    real = triton_sgmv._expand_launch

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        launch = real(*args, **kwargs)
        groups.add(launch[2]["N_GROUP"])
        return launch

    monkeypatch.setattr(triton_sgmv, "_expand_launch", recording)
    dev = torch.device("cuda" if HAS_CUDA else "cpu")
    g = torch.Generator().manual_seed(1)
    A = (torch.randn(3, 16, 32, generator=g) / 8).to(dev)
    B = (torch.randn(3, 64, 16, generator=g) / 4).to(dev)
    before = dict(triton_sgmv.TUNING)
    warm_up_lora_kernels(get_backend(backend), [LoRAWeights(A, B, torch.ones(3, 1, device=dev), (0, 64))], 8)
    assert {1, 2, 4} <= groups
    assert before == triton_sgmv.TUNING


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (compiles are what is counted)")
@pytest.mark.parametrize("backend", ["triton-sgmv", "triton-bgmv", "triton-auto"])
@pytest.mark.parametrize("shrink_pdl", [False, True])  # SGMV's shrink after the base GEMM: its own variants
def test_no_compile_after_warm_up(backend: str, shrink_pdl: bool, monkeypatch) -> None:
    from triton import knobs

    from mmlora.backends import triton_sgmv

    monkeypatch.setitem(triton_sgmv.TUNING, "shrink_pdl", shrink_pdl)
    dev, slots, R, max_tokens = torch.device("cuda"), 8, 64, 4096
    weights = pool(dev, slots, R)
    be = get_backend(backend)
    warm_up_lora_kernels(be, weights, max_tokens)
    compiles = []
    prev = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiles.append(k.get("key"))
    try:
        rng = random.Random(0)
        info = LoRABatchInfo(max_tokens, slots, dev)
        for s, r in enumerate([8, 64, 16, 8, 64, 1, 32, 12]):
            info.set_slot_rank(s, r)
        for _ in range(60):
            kind = rng.choice(["decode", "prefill", "mixed"])
            n_dec = rng.randint(1, 128) if kind != "prefill" else 0
            chunks = [rng.randint(2, 1300) for _ in range(rng.randint(1, 3))] if kind != "decode" else []
            lens = [1] * n_dec + chunks
            seg_slots = [rng.randrange(-1, slots) for _ in lens]
            info.fill(lens, seg_slots)
            if not info.has_lora:
                continue
            for w in weights[: len(SHAPES)]:
                x = torch.randn(sum(lens), w.A.shape[2], device=dev, dtype=w.A.dtype)
                out = torch.zeros(sum(lens), w.B.shape[1], device=dev, dtype=w.A.dtype)
                be.add_lora(out, x, w, info)
                be.add_lora_after_base(out, x, w, info)
                pending = be.defer_lora(x, w, info) if w.gated_pair else None
                if pending is not None:  # gate_up: the expand inside the gated activation, both kinds
                    for act in (0, 1):
                        assert pending.act_and_mul(out, act) is not None
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = prev
    assert compiles == [], f"{len(compiles)} Triton compiles after the warm-up"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (compiles are what is counted)")
@pytest.mark.parametrize("backend", ["triton-sgmv", "triton-auto"])
def test_no_compile_for_wide_decode_runs_after_warm_up(backend: str) -> None:
    """Decode runs over Mistral-wide modules and many segments, where the expand-group rule picks groups of 4,
    2 and 1 by the batch (the warm-up's own batches have one segment): nothing compiles after the warm-up."""
    from triton import knobs

    dev, slots, R = torch.device("cuda"), 8, 16
    g = torch.Generator().manual_seed(2)
    weights = []
    for in_f, widths in [(512, (4096,)), (512, (4096, 1024, 1024)), (512, (14336, 14336))]:
        offs = tuple([0] + [sum(widths[: i + 1]) for i in range(len(widths))])
        A = (torch.randn(slots, len(widths) * R, in_f, generator=g) / 16).to(dev, torch.bfloat16)
        B = (torch.randn(slots, offs[-1], R, generator=g) / 4).to(dev, torch.bfloat16)
        weights.append(LoRAWeights(A, B, torch.ones(slots, len(widths), device=dev), offs))
    be = get_backend(backend)
    warm_up_lora_kernels(be, weights, 1024)
    compiles = []
    prev = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiles.append(k.get("key"))
    try:
        info = LoRABatchInfo(1024, slots, dev)
        for s in range(slots):
            info.set_slot_rank(s, R)
        for runs in (20, 130, 300):  # runs of two rows (SGMV under triton-auto too), on the slots in turn
            info.fill([2] * runs, [i % slots for i in range(runs)])
            for w in weights:
                x = torch.randn(2 * runs, w.A.shape[2], device=dev, dtype=w.A.dtype)
                out = torch.zeros(2 * runs, w.B.shape[1], device=dev, dtype=w.A.dtype)
                be.add_lora(out, x, w, info)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = prev
    assert compiles == [], f"{len(compiles)} Triton compiles after the warm-up"
