"""CPU plans (mmlora.backends.cpu_plan): a recorded chain of C kernel calls and torch ops, replayed on new
inputs, gives what running the same code eagerly on them gives, bit for bit; captures that a replay could not
get right are refused, with the reason."""

from __future__ import annotations

import pytest
import torch

from mmlora.backends import cpu_gemm, cpu_kernels, cpu_plan

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels are not built here")

DTYPES = [torch.float32] + ([torch.bfloat16] if torch.bfloat16 in cpu_gemm.dtypes() else [])


def _weights(dtype: torch.dtype, hidden: int = 48, inter: int = 80) -> dict:
    g = torch.Generator().manual_seed(0)
    up = torch.randn(2 * inter, hidden, generator=g).mul(0.2).to(dtype)
    return {
        "norm1": torch.rand(hidden, generator=g).add(0.5).to(dtype),
        "norm2": torch.rand(inter, generator=g).add(0.5).to(dtype),
        "up_raw": up,
        "up": cpu_gemm.pack(up),
        "table": torch.randn(64, hidden, generator=g).to(dtype),
    }


def _forward(ids: torch.Tensor, w: dict) -> torch.Tensor:
    """embedding (torch) -> RMSNorm -> GEMM -> SiLU-and-mul (C) -> a scale (torch) -> RMSNorm (C)."""
    x = torch.nn.functional.embedding(ids, w["table"])
    h = cpu_kernels.rms_norm_unchecked(x, w["norm1"], 1e-5)
    y = cpu_gemm.matmul_unchecked(h, w["up"])
    z = cpu_kernels.silu_and_mul_unchecked(y) * 3
    return cpu_kernels.rms_norm_unchecked(z, w["norm2"], 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_replay_computes_what_the_eager_code_computes_on_the_new_inputs(dtype):
    w = _weights(dtype)
    ids = torch.tensor([3, 1, 4, 1, 5])  # the static input, rewritten before each replay
    out, plan, reason = cpu_plan.capture(lambda: _forward(ids, w))
    assert reason is None and plan is not None
    assert (plan.kernel_calls, plan.torch_ops) == (4, 2)  # the embedding and the scale are torch ops
    assert torch.equal(out, _forward(ids, w))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids.copy_(torch.randint(0, 64, (5,), generator=g))
        plan.replay()
        expected = _forward(ids, w)
        assert torch.equal(out, expected)
        # and the eager code is right: against a float64 reference of the same chain
        x = w["table"][ids].double()
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w["norm1"].double()
        up = h @ w["up_raw"].double().T
        inter = up.shape[1] // 2
        z = torch.nn.functional.silu(up[:, :inter]) * up[:, inter:] * 3
        ref = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-5) * w["norm2"].double()
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(expected.double(), ref, atol=tol, rtol=tol)


def test_host_inputs_are_filled_again_before_each_replay():
    values = [1.0, 2.0, 3.0]

    def forward() -> torch.Tensor:
        t = torch.empty(3)

        def fill() -> None:
            t.copy_(torch.tensor(values))

        cpu_plan.host_input(fill)
        return t * 2

    out, plan, reason = cpu_plan.capture(forward)
    assert reason is None and out.tolist() == [2.0, 4.0, 6.0]
    values[:] = [4.0, 5.0, 6.0]
    plan.replay()
    assert out.tolist() == [8.0, 10.0, 12.0]


def _python_data(x: torch.Tensor) -> torch.Tensor:
    return x + torch.tensor([1.0, 2.0])


def _read_back(x: torch.Tensor) -> torch.Tensor:
    return x * x.sum().item()


def _masked(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0]


def _random(x: torch.Tensor) -> torch.Tensor:
    return x + torch.rand(2)


@pytest.mark.parametrize(
    "forward, why",
    [
        (_python_data, "Python data"),
        (_read_back, "depends on data"),
        (_masked, "depends on data"),
        (_random, "random"),
    ],
)
def test_a_capture_a_replay_could_not_repeat_is_refused_and_its_result_stands(forward, why):
    x = torch.tensor([0.5, -1.5])
    out, plan, reason = cpu_plan.capture(lambda: forward(x))
    assert plan is None and why in reason
    if forward is not _random:
        assert torch.equal(out, forward(x))


def test_an_integer_gather_is_replayed():
    table = torch.arange(12.0).view(6, 2)
    pos = torch.tensor([5, 0])
    out, plan, reason = cpu_plan.capture(lambda: table[pos] + 1)
    assert reason is None
    pos.copy_(torch.tensor([2, 3]))
    plan.replay()
    assert out.tolist() == [[5.0, 6.0], [7.0, 8.0]]


def test_kernel_calls_are_recorded_only_inside_a_capture():
    x = torch.randn(2, 8)
    w = torch.ones(8)
    _, plan, _ = cpu_plan.capture(lambda: cpu_kernels.rms_norm_unchecked(x, w, 1e-6))
    cpu_kernels.rms_norm_unchecked(x, w, 1e-6)  # after the capture: not recorded anywhere
    assert plan.kernel_calls == 1 and cpu_plan._ACTIVE is None
    with pytest.raises(RuntimeError, match="already in progress"):
        cpu_plan.capture(lambda: cpu_plan.capture(lambda: None))


def test_a_conversion_or_a_reshape_that_copies_is_replayed():
    """``to`` and ``reshape`` are alias-annotated ops, but where they convert or copy the result is new."""
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    (as_float, flat), plan, reason = cpu_plan.capture(lambda: (x.float(), x.t().reshape(12)))
    assert reason is None
    x.copy_(torch.randn(3, 4))
    plan.replay()
    assert torch.equal(as_float, x.float()) and torch.equal(flat, x.t().reshape(12))


def test_another_threads_kernel_calls_stay_out_of_a_capture():
    """Two engines in one process: a forward on another thread during a capture is not recorded into it."""
    import threading

    x, w = torch.randn(2, 8), torch.ones(8)
    started, finish = threading.Event(), threading.Event()

    def other() -> None:
        started.set()
        while not finish.is_set():
            cpu_kernels.rms_norm_unchecked(x, w, 1e-6)

    def forward() -> torch.Tensor:
        worker = threading.Thread(target=other)
        worker.start()
        started.wait()
        out = cpu_kernels.rms_norm_unchecked(x, w, 1e-6)
        for _ in range(50):  # give the other thread time to call the kernel many times
            cpu_kernels.rms_norm_unchecked(x, w, 1e-6)
        finish.set()
        worker.join()
        return out

    _, plan, reason = cpu_plan.capture(forward)
    assert reason is None and plan.kernel_calls == 51
