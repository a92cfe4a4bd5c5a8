"""down's SGMV shrink fused into the gated activation (:mod:`mmlora.backends.triton_sgmv_act_shrink`).

Oracles: the fp64 activation of gate_up, the fp64 per-token LoRA loop of lora_cases.py over that
activation (within the dtype's tolerance), and the unfused path it replaces (the activation kernel, then
SGMV's shrink and expand), which it must equal bit for bit under the interpreter (a few ulp on a GPU). On
CPU under TRITON_INTERPRET=1 at tiny shapes; on a Hopper GPU also in a CUDA graph replayed with new
inputs, with the expand as the base GEMM's dependent launch and without.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from lora_cases import TOL, Case, make_case, reference, route_as_graph_runs  # noqa: E402
from lora_pools import assert_replays_match  # noqa: E402
from test_lora_paged import paged_weights  # noqa: E402

from mmlora.backends import get_backend, triton_sgmv  # noqa: E402
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights  # noqa: E402
from mmlora.layers import fused_ops  # noqa: E402

# The activation kernel the fused one replaces (on CPU too, under the interpreter).
ACTS = {0: fused_ops.silu_and_mul_triton, 1: fused_ops.gelu_tanh_and_mul_triton}
# (T, I = down's in_features, (out,), R, ranks per slot, popularity, token split) at interpreter sizes.
CASES = {
    "decode-distinct": (7, 40, (24,), 16, [16, 8, 4, 16, 2, 16, 8, 1], "distinct", "decode"),
    "decode-basemix": (9, 200, (40,), 16, [16, 4, 8], "base_mix", "decode"),
    "decode-rank-64": (6, 72, (24,), 64, [64, 8, 33], "uniform", "decode"),
}


@pytest.fixture(autouse=True)
def _fusion_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by default until a GPU A/B makes it a default; tested all the same."""
    monkeypatch.setitem(triton_sgmv.TUNING, "act_shrink", True)


def _gate_up(c: Case, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    T, inter = c.x.shape
    return torch.randn(T, 2 * inter, generator=g).to(device=c.x.device, dtype=c.x.dtype)


def _act64(gate_up: torch.Tensor, act: int) -> torch.Tensor:
    g, u = gate_up.double().cpu().chunk(2, dim=-1)
    a = torch.nn.functional.silu(g) if act == 0 else torch.nn.functional.gelu(g, approximate="tanh")
    return a * u


def _fused(c: Case, weights: LoRAWeights, info: LoRABatchInfo, gate_up: torch.Tensor, act: int, backend: str):  # noqa: ANN202
    fused = get_backend(backend).act_and_shrink(gate_up, act, weights, info)
    assert fused is not None, "a decode-runs batch must take the fused kernel"
    activation, finish = fused
    out = c.out.clone()
    finish(out)
    return activation, out


def _check(
    c: Case, weights: LoRAWeights, info: LoRABatchInfo, act: int, backend: str = "triton-sgmv"
) -> None:
    gate_up = _gate_up(c, seed=11)
    activation, out = _fused(c, weights, info, gate_up, act, backend)
    atol, rtol = TOL[c.x.dtype]
    torch.testing.assert_close(activation.double().cpu(), _act64(gate_up, act), atol=atol, rtol=rtol)
    plain_act = ACTS[act](gate_up)
    plain = c.out.clone()
    get_backend("triton-sgmv").add_lora(plain, plain_act, weights, info)
    c.x = activation  # the fp64 oracle from the activation the base GEMM reads
    _, want = reference(c)
    T = info.num_tokens
    assert torch.isfinite(out[:T].double()).all()
    torch.testing.assert_close(out[:T].double().cpu(), want[:T], atol=atol, rtol=rtol)
    if c.x.is_cuda:
        eps = torch.finfo(c.x.dtype).eps  # another tile shape may sum the dot in another order
        torch.testing.assert_close(activation, plain_act, atol=4 * eps, rtol=4 * eps)
        torch.testing.assert_close(out, plain, atol=4 * eps, rtol=4 * eps)
    else:
        assert torch.equal(activation, plain_act), "differs from the activation kernel"
        assert torch.equal(out, plain), "differs from the activation + shrink + expand it fuses"
    base_rows = torch.tensor([s < 0 for s in c.token_slots])
    assert torch.equal(out[:T][base_rows], c.out[:T][base_rows]), "rows without an adapter were modified"


@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_shrink_matches_the_oracle_and_the_unfused_path(
    name: str, dtype: torch.dtype, act: int
) -> None:
    if dtype != torch.float32 and act == 1 and not torch.cuda.is_available():
        pytest.skip("interpreter: SiLU covers the half dtype")
    c = make_case(*CASES[name], dtype, pad_value=float("nan"))
    _check(c, c.weights, c.info, act)


def test_fused_shrink_over_a_graphs_runs_layout() -> None:
    """A decode graph's routing: runs of rows on one slot, base rows, and empty segment entries."""
    c = make_case(*CASES["decode-distinct"], torch.bfloat16, seed=5, pad_value=float("nan"))
    route_as_graph_runs(c, [0, 0, 0, -1, 3, 3, 1])
    _check(c, c.weights, c.info, 0)
    _check(c, c.weights, c.info, 0, backend="triton-auto")  # auto replays such a graph with SGMV


@pytest.mark.parametrize("U", [16, 32])
def test_fused_shrink_on_a_paged_pool(U: int) -> None:
    c = make_case(*CASES["decode-rank-64"], torch.float32, seed=3)
    _check(c, paged_weights(c.A, c.B, c.scalings, c.offsets, U), c.info, 0)


def test_other_batches_and_modules_are_not_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill segments (longer than a token tile), packed modules, a gate_up that does not fit, other
    backends, and the switch off: None, so the caller runs its own activation and the plain path."""
    sgmv = get_backend("triton-sgmv")
    p = make_case(40, 40, (24,), 16, [16, 8], "uniform", "prefill", torch.float32)
    assert p.info.max_seg_len > 16
    assert sgmv.act_and_shrink(_gate_up(p, 1), 0, p.weights, p.info) is None
    q = make_case(7, 40, (24, 8), 16, [16, 8], "distinct", "decode", torch.float32)
    assert sgmv.act_and_shrink(_gate_up(q, 1), 0, q.weights, q.info) is None
    c = make_case(*CASES["decode-distinct"], torch.float32)
    assert sgmv.act_and_shrink(_gate_up(c, 1)[:, :60], 0, c.weights, c.info) is None
    for name in ("torch-gather", "triton-bgmv"):
        assert get_backend(name).act_and_shrink(_gate_up(c, 1), 0, c.weights, c.info) is None
    # triton-auto keeps BGMV for one-token segments
    assert get_backend("triton-auto").act_and_shrink(_gate_up(c, 1), 0, c.weights, c.info) is None
    monkeypatch.setitem(triton_sgmv.TUNING, "act_shrink", False)
    assert sgmv.act_and_shrink(_gate_up(c, 1), 0, c.weights, c.info) is None


def test_the_gated_mlp_takes_the_fused_path_and_equals_the_plain_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LoRALinear.forward_from_gated`` (what GatedMLP calls for down): fused where the backend fuses, the
    same output as the activation followed by the plain LoRA linear."""
    from mmlora.lora.layer import LoRAContext, LoRALinear

    c = make_case(*CASES["decode-basemix"], torch.float32, seed=2)
    inter, out_f = c.x.shape[1], c.out.shape[1]
    base = torch.nn.Linear(inter, out_f, bias=False)
    layer = LoRALinear(base, c.weights, LoRAContext(get_backend("triton-sgmv"), c.info))
    gate_up = _gate_up(c, 4)
    calls = []
    real = triton_sgmv.act_shrink
    monkeypatch.setattr(triton_sgmv, "act_shrink", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        got = layer.forward_from_gated(gate_up, 0, fused_ops.silu_and_mul_triton)
        assert calls, "the fused kernel did not run"
        want = layer(fused_ops.silu_and_mul_triton(gate_up))
        assert torch.equal(layer.forward_from_gated(gate_up, None, fused_ops.silu_and_mul_triton), want)
    assert torch.equal(got, want)


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90+) GPU")
@pytest.mark.parametrize("expand_pdl", [False, True])
def test_fused_chain_replays_in_a_cuda_graph(expand_pdl: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLP layers (gate_up GEMM, the fused activation + down shrink, down's GEMM, its expand) over decode runs
    at Mistral's intermediate width: eager equal to the unfused path within a few ulp, and captured in a CUDA
    graph and replayed with new inputs, the eager fused bits."""
    monkeypatch.setitem(triton_sgmv.TUNING, "act_shrink_expand_pdl", expand_pdl)
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    S, R, hidden, inter, layers = 8, 16, 512, 14336, 3
    stacks = []
    for _ in range(layers):
        A = (torch.randn(S, R, inter, device=dev, generator=g) / inter**0.5).to(dt)
        B = (torch.randn(S, hidden, R, device=dev, generator=g) / 4).to(dt)
        w_up = (torch.randn(2 * inter, hidden, device=dev, generator=g) / hidden**0.5).to(dt)
        w_down = (torch.randn(hidden, inter, device=dev, generator=g) / inter**0.5).to(dt)
        stacks.append((w_up, w_down, LoRAWeights(A, B, torch.full((S, 1), 0.5, device=dev), (0, hidden))))
    slots = sorted(i % S for i in range(40)) + [-1] * 8
    info = LoRABatchInfo(len(slots), S, dev, max_lora_rank=R)
    for s in range(S):
        info.set_slot_rank(s, (16, 8, 4, 16)[s % 4])
    info.fill_rows(slots, rank_bound=R, layout="runs", segments=len(slots) // 2)
    backend = get_backend("triton-sgmv")

    def chain(x: torch.Tensor, fused: bool = True) -> list[torch.Tensor]:
        outs = []
        for w_up, w_down, w in stacks:
            gate_up = x @ w_up.T
            if fused:
                activation, finish = backend.act_and_shrink(gate_up, 0, w, info)
                out = activation @ w_down.T
                finish(out)
            else:
                activation = fused_ops.silu_and_mul(gate_up)
                out = activation @ w_down.T
                backend.add_lora(out, activation, w, info)
            outs.append(out)
            x = out
        return outs

    x0 = torch.randn(len(slots), hidden, device=dev, generator=g).to(dt)
    eps = torch.finfo(dt).eps
    for a, b in zip(chain(x0), chain(x0, fused=False)):
        torch.testing.assert_close(a, b, atol=8 * eps, rtol=8 * eps)
    new_input = lambda: torch.randn(len(slots), hidden, device=dev, generator=g).to(dt)  # noqa: E731
    assert_replays_match(chain, x0, new_input, chain, 3)
