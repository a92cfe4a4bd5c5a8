"""o_proj's and down_proj's SGMV expand fused into the RMSNorm that reads their output
(:mod:`mmlora.backends.triton_sgmv_norm`, opt-in).

Two oracles: the fp64 per-token LoRA loop of test_lora_kernels followed by an fp64 RMSNorm (within the
dtype's tolerance), and the unfused path it replaces (the SGMV expand into the output, then the norm
kernel), which it must equal bit for bit under TRITON_INTERPRET=1 on CPU (a few ulp on a GPU, whose dot
products may sum in another order). Then whole models: greedy tokens and logprobs with the fusion on
equal those with it off.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from test_lora_kernels import DEV, TOL, Case, make_case, reference, route_as_graph_runs  # noqa: E402
from test_lora_paged import paged_weights  # noqa: E402

import mmlora  # noqa: E402
from mmlora.backends import get_backend, triton_sgmv_act, triton_sgmv_norm  # noqa: E402
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights  # noqa: E402
from mmlora.layers import fused_ops  # noqa: E402

# (T, in, (out,), R, ranks per slot, popularity, token split): single-slice (o_proj / down_proj) layouts.
CASES = {
    "decode-distinct": (7, 32, (40,), 16, [16, 8, 4, 16, 2, 16, 8, 1], "distinct", "decode"),
    "decode-basemix": (9, 48, (24,), 16, [16, 4, 8], "base_mix", "decode"),
    "mixed-step": (40, 32, (24,), 16, [16, 8, 4, 1], "base_mix", "mixed"),
    "ranks-1-to-64": (21, 32, (24,), 64, [1, 64, 33, 7], "uniform", "prefill"),
}


@pytest.fixture(autouse=True)
def _fusion_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(triton_sgmv_norm.TUNING, "norm_expand", True)


def _norm64(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.double())


def _inputs(c: Case, offset: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = c.out.shape[1]
    w = (torch.rand(n, generator=g) + 0.5 - offset).to(c.x.dtype).to(DEV)
    res = torch.randn(c.out.shape, generator=g).to(c.x.dtype).to(DEV)
    return w, res


def _check(c: Case, weights: LoRAWeights, info: LoRABatchInfo, offset: float, with_residual: bool) -> None:
    w, res = _inputs(c, offset, seed=4)
    residual = res if with_residual else None
    eps = 1e-5
    pending = get_backend("triton-sgmv").defer_lora(c.x, weights, info, "norm")
    assert pending is not None
    x = c.out.clone()
    got = pending.rms_norm(x, w, eps, offset, residual)
    assert got is not None, "a single-slice output must take the fused kernel"
    assert torch.equal(x, c.out), "the fused norm must not write the module's output"
    unfused_x = c.out.clone()
    get_backend("triton-sgmv").add_lora(unfused_x, c.x, weights, info)
    unfused = fused_ops.rms_norm_triton(unfused_x, w, eps, offset, residual)
    got_t, want_t = (got, unfused) if with_residual else ((got,), (unfused,))
    for a, b in zip(got_t, want_t):
        if c.x.is_cuda or info.rank_bound > 16:
            # Dot products over more than 16 ranks, or on a GPU, may sum in another order for another tile
            # shape (numpy's matmul under the interpreter too): a few ulp.
            e = torch.finfo(c.x.dtype).eps
            torch.testing.assert_close(a, b, atol=4 * e, rtol=4 * e)
        else:
            assert torch.equal(a, b), "differs from the expand + norm it fuses"
    _, out64 = reference(c)
    s64 = out64 + (res.double().cpu() if with_residual else 0)
    atol, rtol = TOL[c.x.dtype]
    y = got[0] if with_residual else got
    torch.testing.assert_close(
        y.double().cpu(), _norm64(s64, w.cpu(), eps, offset), atol=atol * 4, rtol=rtol * 4
    )


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_norm_matches_the_oracle_and_the_unfused_path(name, dtype, offset, with_residual) -> None:
    if dtype != torch.float32 and (offset or not with_residual) and not torch.cuda.is_available():
        pytest.skip("interpreter: Llama's residual norm covers bf16")
    c = make_case(*CASES[name], dtype)
    _check(c, c.weights, c.info, offset, with_residual)


@pytest.mark.parametrize("U", [16, 32])
def test_fused_norm_on_a_paged_pool(U: int) -> None:
    c = make_case(*CASES["ranks-1-to-64"], torch.float32, seed=3)
    _check(c, paged_weights(c.A, c.B, c.scalings, c.offsets, U), c.info, 0.0, True)


def test_fused_norm_over_a_graphs_runs_layout() -> None:
    """A decode graph's routing: runs of rows on one slot, base rows, and empty segment entries."""
    c = make_case(*CASES["decode-distinct"], torch.bfloat16, seed=5)
    route_as_graph_runs(c, [0, 0, 0, -1, 3, 3, 1])
    _check(c, c.weights, c.info, 0.0, True)


def test_deferral_for_norms_follows_its_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_case(*CASES["mixed-step"], torch.float32)
    sgmv = get_backend("triton-sgmv")
    assert sgmv.defer_lora(c.x, c.weights, c.info, "norm") is not None
    monkeypatch.setitem(triton_sgmv_norm.TUNING, "norm_max_tokens", c.info.num_tokens - 1)
    assert sgmv.defer_lora(c.x, c.weights, c.info, "norm") is None  # too many rows: each reads its B
    monkeypatch.setitem(triton_sgmv_norm.TUNING, "norm_max_tokens", 256)
    monkeypatch.setitem(triton_sgmv_norm.TUNING, "norm_expand", False)
    assert sgmv.defer_lora(c.x, c.weights, c.info, "norm") is None
    assert get_backend("triton-bgmv").defer_lora(c.x, c.weights, c.info, "norm") is None
    assert get_backend("torch-gather").defer_lora(c.x, c.weights, c.info, "norm") is None


def test_a_packed_output_falls_back_to_the_expand_then_the_norm() -> None:
    """qkv-like outputs (several slices) are no norm input: the delta is added in place, then the norm."""
    c = make_case(7, 32, (24, 8, 8), 16, [16, 8], "distinct", "decode", torch.float32)
    pending = get_backend("triton-sgmv").defer_lora(c.x, c.weights, c.info, "norm")
    w, res = _inputs(c, 0.0, seed=1)
    assert pending.rms_norm(c.out.clone(), w, 1e-5, 0.0, res) is None


PROMPTS = [[5, 9, 13, 2, 7], [31, 4, 4, 8, 19, 3, 6], [11, 12, 13] * 4, [40, 41, 2, 9]]
LORAS = ["a", "b", None, "a"]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_models_with_the_fused_norms_give_the_same_tokens(tiny, arch, monkeypatch) -> None:
    """Llama (the residual norms, down's delta carried into the next layer and the final norm) and Gemma2
    (its sandwich norms): greedy tokens and logprobs with the fusion on equal those with it off."""
    base, adapters = tiny(arch)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def generate() -> list:
        engine = mmlora.Engine(
            model=str(base), lora_paths=adapters, max_loras_per_batch=2, max_lora_rank=4, device=device,
            dtype="float32", lora_backend="triton-sgmv", attention_backend="triton", disable_cuda_graph=True,
            disable_cpu_graph=True, max_kv_tokens=1024, block_size=4, cpu_fused_lora=False,
        )  # fmt: skip
        return engine.generate(
            input_ids=PROMPTS, lora_paths=LORAS, return_logprob=True,
            sampling_params={"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
        )  # fmt: skip

    calls = []
    fused = triton_sgmv_act.sgmv_norm_expand  # where the deferred delta calls it
    monkeypatch.setattr(triton_sgmv_act, "sgmv_norm_expand", lambda *a: calls.append(1) or fused(*a))
    on = generate()
    assert calls, "no norm took a deferred delta"
    monkeypatch.setitem(triton_sgmv_norm.TUNING, "norm_expand", False)
    off = generate()
    for a, b in zip(on, off):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


@pytest.mark.parametrize("lora_backend", ["triton-sgmv", "triton-auto"])
def test_decode_graph_steps_with_the_fused_norms_launch_what_their_capture_did(
    tiny, lora_backend, monkeypatch
):
    """The decode-graph runner's steps (static buffers, no capture) with the fusion on: every step makes the
    launches of a capture of its (bucket, rank bound, layout), the fused norms among them (graph_safety)."""
    from graph_safety import (
        LaunchLog,
        assert_steps_replay_their_captures,
        persistent_storages,
        record_launches,
    )

    from mmlora.engine.cuda_graph import CudaGraphRunner

    base, adapters = tiny()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = mmlora.Engine(
        model=str(base), lora_paths=adapters, max_loras_per_batch=2, max_lora_rank=4, device=device,
        dtype="float32", lora_backend=lora_backend, attention_backend="triton", disable_cuda_graph=True,
        disable_cpu_graph=True, max_kv_tokens=1024, block_size=4, cpu_fused_lora=False, max_running_requests=4,
    )  # fmt: skip
    runner = engine.runner
    graphs = runner.decode_graphs = CudaGraphRunner(runner, 4, engine.max_model_len, capture=False)
    forward = graphs._forward
    with torch.inference_mode():  # a capture's warm-up
        runner.lora.prepare_capture(4, 4, runner.lora.graph_layouts[0])
        forward(4)
    names = ("i64", "seq_lens", "block_tables", "query_start_loc", "logits_rows")
    log = LaunchLog(persistent_storages(engine, [(f"runner {n}", getattr(graphs, n)) for n in names]))
    record_launches(monkeypatch, log)
    steps: list[tuple] = []

    def recorded(bs: int) -> torch.Tensor:
        log.start()
        with log.mode:
            logits = forward(bs)
        log.on = False
        steps.append((graphs.last_key, log.calls))
        return logits

    def capture(key: tuple[int, int, str]) -> None:
        bs, bound, layout = key
        runner.lora.prepare_capture(bs, bound, layout)
        log.start()
        forward(bs)

    graphs._forward = recorded
    engine.generate(
        input_ids=PROMPTS, lora_paths=["a", "a", "a", None], return_logprob=True,
        sampling_params={"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
    )  # fmt: skip
    graphs._forward = forward
    assert len(steps) > 3 and any(key[1] for key, _ in steps)
    captured = assert_steps_replay_their_captures(log, steps, capture)
    launched = {c[0] for key, calls in captured.items() if key[1] and key[2] == "runs" for c in calls}
    assert "_sgmv_norm_expand_kernel" in launched
