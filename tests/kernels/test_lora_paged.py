"""LoRA backends on a pool paged by rank tile (``LoRAWeights`` 4-D: ranks c*U .. c*U + U - 1 of a slot in
its page c) against the fp64 per-token oracle of lora_cases.py, which reads the unpaged pool the pages
were made from. For the Triton kernels the padding past each adapter's rank is NaN, so a read of it would
show (torch-gather may multiply the padding, which the pool keeps at zero)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from lora_cases import CPU_CASES, HAS_CUDA, assert_out, make_case, reference, reference_fast  # noqa: E402

from mmlora.backends import get_backend, triton_sgmv  # noqa: E402
from mmlora.forward.lora import LoRAWeights, page_weights, unpage_a, unpage_b  # noqa: E402

BACKENDS = ["torch-gather", "triton-sgmv", "triton-bgmv", "triton-auto", "triton-fused"]


def paged_weights(A: torch.Tensor, B: torch.Tensor, scalings, offsets, U: int) -> LoRAWeights:
    """The paged copy of an unpaged pool A [S, n*R, in], B [S, out, R]."""
    weights = page_weights(LoRAWeights(A, B, scalings, offsets), U)
    exact = dict(rtol=0, atol=0, equal_nan=True)  # the unpaging helpers invert it
    torch.testing.assert_close(unpage_a(weights.A, weights.n_slices), A, **exact)
    torch.testing.assert_close(unpage_b(weights.B), B, **exact)
    assert (weights.pages, weights.page_rank) == (B.shape[2] // U, U)
    return weights


# (case of lora_cases.py, page rank): several pages a slot, ranks within a page, whole pages, and
# ranks ending inside a later page.
PAGED = [
    ("decode-distinct-qkv", 8),
    ("decode-distinct-qkv", 4),
    ("prefill-uniform-qkv", 4),
    ("mixed-step-qkv", 8),
    ("mixed-ranks-1-to-128", 16),
    ("decode-zipf-single", 2),
    ("prefill-basemix-gateup", 8),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,U", PAGED, ids=[f"{n}-U{u}" for n, u in PAGED])
def test_paged_pool_matches_the_reference(backend: str, name: str, U: int) -> None:
    pad = 0.0 if backend == "torch-gather" else float("nan")
    c = make_case(*CPU_CASES[name], dtype=torch.float32, seed=7, pad_value=pad)
    _, want = reference(c)
    weights = paged_weights(c.A, c.B, c.scalings, c.offsets, U)
    out0 = c.out.clone()
    get_backend(backend).add_lora(c.out, c.x, weights, c.info)
    assert_out(c, c.out, want, out0)


@pytest.mark.parametrize(
    "name,U,latency_knobs",
    [("decode-distinct-qkv", 8, False), ("decode-distinct-qkv", 4, True), ("decode-zipf-single", 2, True)],
)
def test_sgmv_expand_groups_on_a_paged_pool(
    name: str, U: int, latency_knobs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGMV's grouped expand for decode runs (``run_expand_group``) reads B through its pages, with its
    first tile's B loaded early and h's planes summed unrolled too."""
    monkeypatch.setitem(triton_sgmv.TUNING, "block_n", 16)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_group", 3)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_group_programs", None)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_group_b_first", latency_knobs)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_h_unroll", 4 if latency_knobs else None)
    c = make_case(*CPU_CASES[name], dtype=torch.float32, seed=13, pad_value=float("nan"))
    _, want = reference(c)
    weights = paged_weights(c.A, c.B, c.scalings, c.offsets, U)
    out0 = c.out.clone()
    get_backend("triton-sgmv").add_lora(c.out, c.x, weights, c.info)
    assert_out(c, c.out, want, out0)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton-sgmv", "triton-bgmv", "triton-auto"])
@pytest.mark.parametrize("T,mode,pattern", [(32, "decode", "distinct"), (256, "decode", "zipf"),
                                            (1064, "mixed", "uniform")])  # fmt: skip
def test_paged_pool_at_real_shapes_on_gpu(backend: str, T: int, mode: str, pattern: str) -> None:
    ranks = [8, 16, 64, 16, 8, 64, 32, 1] * 4
    c = make_case(T, 4096, (4096, 1024, 1024), 64, ranks, pattern, mode, torch.bfloat16, seed=T)
    _, want = reference_fast(c)
    weights = paged_weights(c.A, c.B, c.scalings, c.offsets, 16)
    out0 = c.out.clone()
    get_backend(backend).add_lora(c.out, c.x, weights, c.info)
    assert_out(c, c.out, want, out0)


@pytest.mark.parametrize("backend", ["triton-sgmv", "triton-bgmv"])
def test_an_engine_on_a_paged_pool_gives_the_unpaged_pools_tokens(tmp_path, backend: str) -> None:
    """The pool's own paged views (slot s: the pages from s on, which run into the next adapter's pages)
    through the Triton kernels: three rank-4 adapters and one of rank 8 in room for two of rank 8, pages
    of 4, against an unpaged pool, greedy tokens equal."""
    from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint

    import mmlora

    base = make_checkpoint(tmp_path / "base", "llama")
    ranks = {"a0": 4, "a1": 4, "a2": 8, "a3": 4}
    paths = {
        n: str(make_adapter(base, tmp_path / n, seed=i, r=r, lora_alpha=8, target_modules=ALL_SEVEN))
        for i, (n, r) in enumerate(ranks.items())
    }
    prompts = ["Hello world", "The quick brown fox", "Paris is", "0123"]
    params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    outs = []
    for page_rank in (None, 4):
        eng = mmlora.Engine(
            model=str(base), lora_paths=paths, device="cpu", dtype="float32", max_lora_rank=8,
            max_loras_per_batch=2, lora_page_rank=page_rank, lora_backend=backend,
        )  # fmt: skip
        outs.append([o.output_ids for o in eng.generate(prompts, list(ranks), sampling_params=params)])
    assert outs[0] == outs[1]
