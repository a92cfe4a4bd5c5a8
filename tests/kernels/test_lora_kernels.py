"""LoRA backends (torch-gather, triton-sgmv, triton-bgmv) against a plain fp64 per-token loop
(the cases and oracle in ``lora_cases.py``; SGMV's decode-run knobs in ``test_sgmv_run_knobs.py``).

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

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
from lora_cases import (  # noqa: E402
    BACKENDS,
    CPU_CASES,
    DTYPES,
    HAS_CUDA,
    TRITON,
    assert_out,
    make_case,
    reference,
    reference_fast,
)

from mmlora.backends import get_backend, triton_bgmv, triton_sgmv  # noqa: E402
from mmlora.backends.torch_gather import gather_expand, gather_shrink  # noqa: E402
from mmlora.backends.triton_bgmv import bgmv_expand, bgmv_shrink  # noqa: E402
from mmlora.backends.triton_sgmv import sgmv_expand, sgmv_shrink  # noqa: E402

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


# Each backend's two kernel entry points (its private split of add_lora), tested on their own too.
SHRINK_EXPAND = {
    "torch-gather": (gather_shrink, gather_expand),
    "triton-sgmv": (sgmv_shrink, sgmv_expand),
    "triton-bgmv": (bgmv_shrink, bgmv_expand),
}


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
