"""gate_up's SGMV expand fused into the gated activation (:mod:`mmlora.backends.triton_sgmv_act`).

Two oracles: the fp64 per-token loop of lora_cases.py followed by the activation in fp64 (within the
dtype's tolerance), and the unfused path it replaces (the SGMV expand into gate_up, then the activation
kernel), which it must equal bit for bit. Under TRITON_INTERPRET=1 on CPU at tiny shapes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from lora_cases import TOL, Case, make_case, reference, route_as_graph_runs  # noqa: E402
from test_lora_paged import paged_weights  # noqa: E402

from mmlora.backends import get_backend, triton_sgmv, triton_sgmv_act  # noqa: E402
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights  # noqa: E402
from mmlora.layers import fused_ops  # noqa: E402

ACTS = {
    0: (fused_ops.silu_and_mul, fused_ops.silu_and_mul_triton),
    1: (fused_ops.gelu_tanh_and_mul, fused_ops.gelu_tanh_and_mul_triton),
}
# (T, in, (I, I), R, ranks per slot, popularity, token split): gate_up layouts at interpreter sizes.
CASES = {
    "decode-distinct": (7, 32, (24, 24), 16, [16, 8, 4, 16, 2, 16, 8, 1], "distinct", "decode"),
    "decode-basemix": (9, 32, (40, 40), 16, [16, 4, 8], "base_mix", "decode"),
    # a chunk longer than the token tiles among decode rows: the tile table
    "mixed-step": (78, 32, (24, 24), 16, [16, 8, 4, 1], "base_mix", "mixed"),
    # a pool of rank 128: the rank loop takes several steps; ranks 1..128 in one batch
    "prefill-ranks-1-to-128": (37, 32, (24, 24), 128, [1, 128, 64, 7, 33], "uniform", "prefill"),
}


@pytest.fixture(autouse=True)
def _runs_deferred_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """16-token tiles (decode runs) are not deferred by default (measured slower); tested all the same."""
    monkeypatch.setitem(triton_sgmv_act.TUNING, "runs", True)


def _act64(gate_up: torch.Tensor, act: int) -> torch.Tensor:
    g, u = gate_up.double().chunk(2, dim=-1)
    a = torch.nn.functional.silu(g) if act == 0 else torch.nn.functional.gelu(g, approximate="tanh")
    return a * u


def _unfused(c: Case, weights: LoRAWeights, info: LoRABatchInfo, act: int) -> torch.Tensor:
    gate_up = c.out.clone()
    get_backend("triton-sgmv").add_lora(gate_up, c.x, weights, info)
    return ACTS[act][1](gate_up)


def _fused(c: Case, weights: LoRAWeights, info: LoRABatchInfo, act: int) -> torch.Tensor:
    gate_up = c.out.clone()
    pending = get_backend("triton-sgmv").defer_lora(c.x, weights, info)
    assert pending is not None
    got = pending.act_and_mul(gate_up, act)
    assert got is not None, "a gate_up layout must take the fused kernel"
    assert torch.equal(gate_up, c.out), "the fused activation must not write gate_up"
    return got


def _check(c: Case, weights: LoRAWeights, info: LoRABatchInfo, act: int) -> None:
    got = _fused(c, weights, info, act)
    T = info.num_tokens
    _, out64 = reference(c)
    atol, rtol = TOL[c.x.dtype]
    torch.testing.assert_close(got[:T].double().cpu(), _act64(out64[:T], act), atol=atol, rtol=rtol)
    _assert_same_as_unfused(got, _unfused(c, weights, info, act))


def _assert_same_as_unfused(got: torch.Tensor, unfused: torch.Tensor) -> None:
    if got.is_cuda:
        # The GPU's dot products may sum in another order for another tile shape (seen in fp32, e.g. where
        # the plain expand takes column-tile groups, run_expand_group_programs): a few ulp.
        eps = torch.finfo(got.dtype).eps
        torch.testing.assert_close(got, unfused, atol=4 * eps, rtol=4 * eps)
    else:
        assert torch.equal(got, unfused), "differs from the expand + activation it fuses"


@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_activation_matches_the_oracle_and_the_unfused_path(
    name: str, dtype: torch.dtype, act: int
) -> None:
    if dtype != torch.float32 and act == 1 and not torch.cuda.is_available():
        pytest.skip("interpreter: SiLU covers the half dtypes")
    c = make_case(*CASES[name], dtype)
    _check(c, c.weights, c.info, act)


@pytest.mark.parametrize("U", [16, 32])
def test_fused_activation_on_a_paged_pool(U: int) -> None:
    c = make_case(*CASES["prefill-ranks-1-to-128"], torch.float32, seed=3)
    _check(c, paged_weights(c.A, c.B, c.scalings, c.offsets, U), c.info, 0)


def test_fused_activation_over_a_graphs_runs_layout() -> None:
    """A decode graph's routing: runs of rows on one slot, base rows, and empty segment entries."""
    c = make_case(*CASES["decode-distinct"], torch.bfloat16, seed=5)
    route_as_graph_runs(c, [0, 0, 0, -1, 3, 3, 1])
    _check(c, c.weights, c.info, 0)


def test_other_layouts_fall_back_to_the_expand_then_the_activation() -> None:
    """Unequal slices are no gate | up output: the deferred delta is added to gate_up, then the plain
    activation runs, as without deferral."""
    c = make_case(7, 32, (24, 40), 16, [16, 8], "distinct", "decode", torch.float32)
    pending = get_backend("triton-sgmv").defer_lora(c.x, c.weights, c.info)
    assert pending.act_and_mul(c.out.clone(), 0) is None
    gate_up = c.out[:, :48].clone()  # a [T, 2I] tensor the pending delta does not fit
    with pytest.raises(ValueError):
        fused_ops.silu_and_mul(gate_up, pending)
    gate_up = c.out.clone()
    pending.apply(gate_up)
    _, want = reference(c)
    torch.testing.assert_close(gate_up.double().cpu(), want, atol=1e-4, rtol=1e-4)


def test_act_with_a_deferred_delta_equals_the_plain_path() -> None:
    """fused_ops' activations take the deferred delta (the model's GatedMLP passes it)."""
    c = make_case(*CASES["decode-basemix"], torch.float32, seed=7)
    for act, (fn, _) in ACTS.items():
        pending = get_backend("triton-sgmv").defer_lora(c.x, c.weights, c.info)
        _assert_same_as_unfused(fn(c.out.clone(), pending), _unfused(c, c.weights, c.info, act))


def test_deferral_follows_the_tuning_switch_and_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_case(*CASES["decode-distinct"], torch.float32)
    assert get_backend("torch-gather").defer_lora(c.x, c.weights, c.info) is None
    assert get_backend("triton-bgmv").defer_lora(c.x, c.weights, c.info) is None
    # triton-auto defers where it picks SGMV (segments longer than one token), not for decode rows
    assert get_backend("triton-auto").defer_lora(c.x, c.weights, c.info) is None
    m = make_case(*CASES["mixed-step"], torch.float32)
    assert get_backend("triton-auto").defer_lora(m.x, m.weights, m.info) is not None
    assert get_backend("triton-sgmv").defer_lora(c.x, c.weights, c.info) is not None
    monkeypatch.setitem(triton_sgmv_act.TUNING, "runs", False)  # the default: decode runs keep the expand
    assert get_backend("triton-sgmv").defer_lora(c.x, c.weights, c.info) is None
    assert get_backend("triton-sgmv").defer_lora(m.x, m.weights, m.info) is not None
    monkeypatch.setitem(triton_sgmv.TUNING, "act_expand", False)
    assert get_backend("triton-sgmv").defer_lora(m.x, m.weights, m.info) is None


@pytest.mark.parametrize("max_split", [1, 2, 16])
def test_fused_activation_sums_every_split_k_plane(max_split: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planes of h summed with unrolled loads (up to ``max_split``) or with a loop (more planes than that)."""
    monkeypatch.setattr(triton_sgmv.TritonSGMVBackend, "split_k", 3)
    monkeypatch.setitem(triton_sgmv_act.TUNING, "max_split", max_split)
    c = make_case(*CASES["mixed-step"], torch.float32, seed=11)
    _check(c, c.weights, c.info, 0)
