"""The LoRA expand as a programmatic dependent launch of its shrink (PDL, ``TUNING["pdl"]`` of the BGMV
and SGMV backends): it starts while the shrink runs and waits for it only before reading its partials;
and SGMV's shrink as one of the base GEMM before it (``TUNING["shrink_pdl"]``, ``add_lora_after_base``).
On a Hopper GPU: a chain of layers (base GEMM, LoRA add, the next layer reading that output), eager and
in a CUDA graph replayed with new inputs, gives the same bits with PDL as without, and matches the
float64 reference; the expand was really compiled for a dependent launch. On CPU and older GPUs PDL
stays off."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from lora_pools import assert_replays_match, lora_reference_f64  # noqa: E402

from mmlora.backends import get_backend, triton_bgmv, triton_sgmv  # noqa: E402
from mmlora.backends.triton_common import pdl_launch  # noqa: E402
from mmlora.forward import LoRABatchInfo, LoRAWeights  # noqa: E402
from mmlora.triton_launch import fast  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_pdl_is_off_on_cpu_and_when_not_asked() -> None:
    assert not pdl_launch(torch.device("cpu"), True)
    if torch.cuda.is_available():
        assert not pdl_launch(torch.device("cuda"), False)
        assert pdl_launch(torch.device("cuda"), True) == HOPPER


def _sgmv_plan(monkeypatch, hopper: bool, after: bool, **tuning):  # noqa: ANN001, ANN003, ANN202
    """The SGMV module plan of a small decode-runs batch as on a Hopper GPU (``pdl_launch`` answering what
    it would there; launch plans are only built, never launched), ``after`` as ``_fused_after_base`` asks."""
    monkeypatch.setattr(triton_sgmv, "pdl_launch", lambda device, wanted: wanted and hopper)
    for knob, value in tuning.items():
        monkeypatch.setitem(triton_sgmv.TUNING, knob, value)
    S, R, hidden = 4, 16, 64
    w = LoRAWeights(torch.zeros(S, 3 * R, hidden), torch.zeros(S, 96, R), torch.ones(S, 3), (0, 32, 64, 96))
    info = LoRABatchInfo(10, S, torch.device("cpu"))
    for slot in range(S):
        info.set_slot_rank(slot, R)
    info.fill([3, 2, 4, 1], [0, 1, 3, -1])
    x = torch.zeros(10, hidden)
    shrink_after = triton_sgmv.TUNING["shrink_pdl"] if after else False
    plan = triton_sgmv._ModulePlan.of(x, w, info, R, 96, None, triton_sgmv.TUNING["pdl"], shrink_after)
    shrink = fast(triton_sgmv._sgmv_shrink_kernel)
    # The interpreter's plans keep every keyword; compiled kernels' keep constexprs among the values.
    if shrink.names:
        after_flag = plan.shrink.values[shrink.names.index("AFTER")]
    else:
        after_flag = plan.shrink.kwargs["AFTER"]
    return after_flag, plan.shrink.kwargs.get("launch_pdl", False)


@pytest.mark.parametrize(
    "hopper,after,tuning,want",
    [
        (True, True, {"shrink_pdl": True}, True),
        (True, False, {"shrink_pdl": True}, False),  # plain add_lora: whatever wrote x may still run
        (True, True, {"shrink_pdl": False}, False),
        (True, True, {"shrink_pdl": True, "pdl": False}, False),  # only with the expand's PDL wait
        (True, True, {"shrink_pdl": True, "run_expand_early_out": True}, False),  # out read before the wait
        (False, True, {"shrink_pdl": True}, False),  # CPU, interpreter, pre-Hopper
    ],
)
def test_the_shrink_follows_the_base_gemm_as_a_dependent_only_where_that_is_safe(
    hopper, after, tuning, want, monkeypatch
) -> None:
    """AFTER (the shrink waits for the kernel before it at every exit) and the dependent launch come
    together, and only for ``add_lora_after_base`` on Hopper with the expand's PDL and no early out read."""
    monkeypatch.setitem(triton_sgmv.TUNING, "pdl", True)
    monkeypatch.setitem(triton_sgmv.TUNING, "run_expand_early_out", False)
    got_after, got_launch = _sgmv_plan(monkeypatch, hopper, after, **tuning)
    assert bool(got_after) is want and bool(got_launch) is want


def _with_knob_off(monkeypatch, tuning: dict, knob: str, chain, info: LoRABatchInfo):  # noqa: ANN001, ANN202
    """``chain(static)`` run eagerly with ``tuning[knob]`` off, then on again (launch plans rebuilt each
    time: they are per forward): the plain launches' bits that a capture with the knob on must replay."""

    def plain(static: torch.Tensor) -> list[torch.Tensor]:
        monkeypatch.setitem(tuning, knob, False)
        info.host_derived.clear()
        want = chain(static)
        monkeypatch.setitem(tuning, knob, True)
        info.host_derived.clear()
        return want

    return plain


#: SGMV's decode-run expand knobs that move loads around the PDL wait (h's planes unrolled after it; the
#: first grouped tile's B before it and its out right after it; groups of 2 at these small batches too).
LATENCY_KNOBS = {
    "run_expand_h_unroll": 16,
    "run_expand_group_b_first": True,
    "run_expand_group_programs": None,
}
RUNS = ([3, 2, 4, 1, 6], [0, 1, 3, -1, 2])  # decode runs, one base-only


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90+) GPU")
@pytest.mark.parametrize(
    "name,module,lens,slots,tuning",
    [
        ("triton-bgmv", triton_bgmv, [1] * 24, [i % 5 - 1 for i in range(24)], {}),  # decode rows, some base
        ("triton-sgmv", triton_sgmv, *RUNS, {}),
        ("triton-sgmv", triton_sgmv, [70, 5, 50], [2, -1, 0], {}),  # prefill segments
        ("triton-sgmv", triton_sgmv, *RUNS, {"shrink_pdl": True}),  # ... the shrink after the GEMM
        ("triton-sgmv", triton_sgmv, [70, 5, 50], [2, -1, 0], {"shrink_pdl": True}),
        ("triton-sgmv", triton_sgmv, *RUNS, LATENCY_KNOBS),
        ("triton-sgmv", triton_sgmv, *RUNS, {"shrink_pdl": True, **LATENCY_KNOBS}),
    ],
)
def test_pdl_chain_equals_plain_launches_and_the_reference(
    name, module, lens, slots, tuning, monkeypatch
) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    S, R, hidden, offs = 4, 16, 512, (0, 512, 640, 768)
    layers = 6
    stacks = []
    for _ in range(layers):
        A = (torch.randn(S, 3 * R, hidden, device=dev, generator=g) / 16).to(dt)
        B = (torch.randn(S, offs[-1], R, device=dev, generator=g) / 4).to(dt)
        W = (torch.randn(offs[-1], hidden, device=dev, generator=g) / 24).to(dt)
        stacks.append((W, LoRAWeights(A, B, torch.full((S, 3), 0.5, device=dev), offs)))
    info = LoRABatchInfo(sum(lens), S, dev)
    for s, r in enumerate((16, 8, 16, 4)):
        info.set_slot_rank(s, r)
    info.fill(lens, slots)
    backend = get_backend(name)
    for knob, value in tuning.items():
        monkeypatch.setitem(module.TUNING, knob, value)

    def chain(x: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's output (base GEMM then LoRA); the next layer reads its first ``hidden`` columns."""
        outs = []
        for W, w in stacks:
            out = x @ W.T
            backend.add_lora_after_base(out, x, w, info)
            outs.append(out)
            x = out[:, :hidden].contiguous()
        return outs

    T = info.num_tokens
    x0 = torch.randn(T, hidden, device=dev, generator=g).to(dt)
    monkeypatch.setitem(module.TUNING, "pdl", False)
    plain = chain(x0)
    monkeypatch.setitem(module.TUNING, "pdl", True)
    info.host_derived.clear()  # launch plans are per forward: new ones with PDL
    with_pdl = chain(x0)
    for a, b in zip(with_pdl, plain):
        assert torch.equal(a, b)
    x = x0
    for (W, w), out in zip(stacks, with_pdl):  # each layer against float64 from the same input
        base = x @ W.T
        torch.testing.assert_close(out.double(), lora_reference_f64(base, x, w, info), rtol=2e-2, atol=2e-2)
        x = out[:, :hidden].contiguous()
    expands = fast(module._bgmv_expand_kernel if module is triton_bgmv else module._sgmv_expand_kernel)
    assert any(k.metadata.launch_pdl for k in expands._compiled.values()), "no expand compiled for PDL"
    if tuning.get("shrink_pdl"):
        shrinks = fast(module._sgmv_shrink_kernel)._compiled.values()
        assert any(k.metadata.launch_pdl for k in shrinks), "no shrink compiled as the GEMM's dependent"

    # Captured with PDL and replayed with new inputs: the plain launches' bits.
    plain = _with_knob_off(monkeypatch, module.TUNING, "pdl", chain, info)
    assert_replays_match(chain, x0, lambda: torch.randn(T, hidden, device=dev, generator=g).to(dt), plain, 3)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90+) GPU")
@pytest.mark.parametrize(
    "name,module,tuning",
    [
        ("triton-bgmv", triton_bgmv, {}),
        ("triton-sgmv", triton_sgmv, {}),
        ("triton-sgmv", triton_sgmv, LATENCY_KNOBS),
    ],
)
@pytest.mark.parametrize("in_f,widths", [(14336, (4096,)), (4096, (4096, 1024, 1024))])
def test_pdl_expand_never_reads_partials_before_the_shrink_wrote_them(
    name, module, tuning, in_f, widths, monkeypatch
) -> None:
    """Every scratch tensor the backends allocate with torch.empty comes NaN-filled, so an expand that read
    its shrink's partials before the shrink wrote them would produce NaN; with a long shrink (in_features
    14336, 256 decode rows sorted by adapter, so SGMV runs over runs and BGMV over rows) and PDL on, the
    result must be finite and carry the bits of plain launches, call after call."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(3)
    S, R, T, out_f = 32, 16, 256, sum(widths)
    offs = tuple([0] + [sum(widths[: i + 1]) for i in range(len(widths))])
    A = (torch.randn(S, len(widths) * R, in_f, device=dev, generator=g) / in_f**0.5).to(dt)
    B = (torch.randn(S, out_f, R, device=dev, generator=g) / 4).to(dt)
    weights = LoRAWeights(A, B, torch.full((S, len(widths)), 0.5, device=dev), offs)
    x = torch.randn(T, in_f, device=dev, generator=g).to(dt)
    out0 = torch.randn(T, out_f, device=dev, generator=g).to(dt)
    slots = sorted(i % S for i in range(T))
    info = LoRABatchInfo(T, S, dev)
    for s in range(S):
        info.set_slot_rank(s, R)
    info.fill([1] * T, slots)
    backend = get_backend(name)
    for knob, value in tuning.items():
        monkeypatch.setitem(module.TUNING, knob, value)

    def run(pdl: bool) -> torch.Tensor:
        monkeypatch.setitem(module.TUNING, "pdl", pdl)
        info.host_derived.clear()
        out = out0.clone()
        backend.add_lora(out, x, weights, info)
        return out

    plain = run(False)
    assert torch.isfinite(plain).all()
    empty = torch.empty

    def nan_empty(*args, **kwargs):  # noqa: ANN002, ANN003
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    for _ in range(20):
        got = run(True)
        assert torch.isfinite(got).all()
        assert torch.equal(got, plain)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90+) GPU")
def test_fused_ops_as_dependents_of_the_expand_keep_the_bits(monkeypatch) -> None:
    """``TUNING["expand_dependents"]``: the fused ops that read a decode-run expand's output (the gated
    activation, the add + RMSNorm, RoPE) launched as its programmatic dependents, the expand letting them
    launch at its start. MLP-and-rotary layers over decode runs, eager and captured in a CUDA graph replayed
    with new inputs: the bits of plain launches; the ops were really compiled as dependent launches."""
    from mmlora.layers import fused_ops, rotary_ops

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(5)
    S, R, hidden, heads, layers = 4, 16, 512, 4, 4
    head_dim = hidden // heads
    slots = sorted(i % S for i in range(48)) + [-1] * 16
    info = LoRABatchInfo(len(slots), S, dev, max_lora_rank=R)
    for s in range(S):
        info.set_slot_rank(s, (16, 8, 16, 4)[s])
    info.fill_rows(slots, rank_bound=R, layout="runs", segments=len(slots) // 2)
    T = len(slots)

    def lora(n_slices: int, in_f: int, width: int) -> LoRAWeights:
        A = (torch.randn(S, n_slices * R, in_f, device=dev, generator=g) / in_f**0.5).to(dt)
        B = (torch.randn(S, n_slices * width, R, device=dev, generator=g) / 4).to(dt)
        offs = tuple(i * width for i in range(n_slices + 1))
        return LoRAWeights(A, B, torch.full((S, n_slices), 0.5, device=dev), offs)

    stacks = []
    for _ in range(layers):
        w_up = (torch.randn(2 * hidden, hidden, device=dev, generator=g) / hidden**0.5).to(dt)
        w_down = (torch.randn(hidden, hidden, device=dev, generator=g) / hidden**0.5).to(dt)
        norm = (1 + torch.randn(hidden, device=dev, generator=g) / 8).to(dt)
        stacks.append((w_up, lora(2, hidden, hidden), w_down, lora(1, hidden, hidden), norm))
    cos = torch.cos(torch.randn(T, head_dim, device=dev, generator=g)).to(dt)
    sin = torch.sin(torch.randn(T, head_dim, device=dev, generator=g)).to(dt)
    backend = get_backend("triton-sgmv")

    def chain(x: torch.Tensor) -> list[torch.Tensor]:
        outs, residual = [], x
        for w_up, up_lora, w_down, down_lora, norm in stacks:
            gate_up = x @ w_up.T
            backend.add_lora(gate_up, x, up_lora, info)
            q, k = rotary_ops.apply_rotary_triton(
                gate_up[:, :hidden].view(T, heads, head_dim),
                gate_up[:, hidden:].view(T, heads, head_dim),
                cos,
                sin,
            )
            act = fused_ops.silu_and_mul_triton(gate_up)
            down = act @ w_down.T
            backend.add_lora(down, act, down_lora, info)
            x, residual = fused_ops.rms_norm_triton(down, norm, 1e-6, 0.0, residual)
            outs += [q, k, act, x, residual]
        return outs

    x0 = torch.randn(T, hidden, device=dev, generator=g).to(dt)
    monkeypatch.setitem(triton_sgmv.TUNING, "expand_dependents", False)
    plain = chain(x0)
    monkeypatch.setitem(triton_sgmv.TUNING, "expand_dependents", True)
    info.host_derived.clear()  # launch plans are per forward: new ones with the trigger
    for a, b in zip(chain(x0), plain):
        assert torch.equal(a, b)
    for kernel in (fused_ops._rms_norm_kernel, fused_ops._act_and_mul_kernel, rotary_ops._rope_kernel):
        assert any(k.metadata.launch_pdl for k in fast(kernel)._compiled.values()), f"{kernel} not dependent"

    new_input = lambda: torch.randn(T, hidden, device=dev, generator=g).to(dt)  # noqa: E731
    plain_of = _with_knob_off(monkeypatch, triton_sgmv.TUNING, "expand_dependents", chain, info)
    assert_replays_match(chain, x0, new_input, plain_of, 3)
