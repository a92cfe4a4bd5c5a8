"""Direct launches of compiled Triton kernels (:mod:`mmlora.triton_launch`).

The launch key must split calls exactly where Triton's specialization does (or finer): sharing a compiled
kernel between an aligned and a misaligned pointer, or between a stride of 16 and one of 17, would run
code compiled for the wrong assumption. On CPU: the key of every argument kind, and the cache's routing
(first call of a key through Triton, later ones direct with the same arguments, a new key through Triton
again) against a stand-in kernel. On a GPU: the real kernels, direct against through Triton, bit for bit,
at aligned and misaligned inputs and inside a CUDA graph.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

import mmlora.triton_launch as tl_launch  # noqa: E402
from mmlora.triton_launch import FastKernel, arg_spec  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def test_int_keys_follow_triton_specialization() -> None:
    # specialized: == 1 and % 16 are separate; the type range too
    assert arg_spec(1, True) != arg_spec(17, True)
    assert arg_spec(16, True) != arg_spec(17, True)
    assert arg_spec(16, True) == arg_spec(48, True)
    assert arg_spec(17, True) == arg_spec(33, True)
    assert arg_spec(2**31 - 1, True) != arg_spec(2**31, True)  # i32 against i64
    assert arg_spec(2**63, True) != arg_spec(2**62, True)  # u64 against i64
    # do_not_specialize: only the type range
    assert arg_spec(1, False) == arg_spec(16, False) == arg_spec(17, False)
    assert arg_spec(5, False) != arg_spec(2**40, False)
    assert arg_spec(True, True) != arg_spec(1, True)  # a bool is not an int here
    assert arg_spec(0.5, True) == arg_spec(3.0, True)  # floats are never specialized on value
    with pytest.raises(TypeError, match="no launch key"):
        arg_spec("text", True)


def test_tensor_keys_hold_dtype_and_alignment() -> None:
    buf = torch.zeros(64, dtype=torch.float16)
    aligned, off_by_one, off_by_eight = buf[:8], buf[1:9], buf[8:16]
    assert arg_spec(aligned, True) == arg_spec(off_by_eight, True)  # both 16-byte aligned
    assert arg_spec(aligned, True) != arg_spec(off_by_one, True)
    assert arg_spec(aligned, True) != arg_spec(buf.float()[:8], True)


class _Compiled:
    def __init__(self) -> None:
        self.function, self.packed_metadata = object(), object()
        self.calls: list[tuple] = []

    def run(self, *args) -> None:  # noqa: ANN002
        self.calls.append(args)


class _StandIn:
    """A jitted kernel's surface: its params, and ``[grid](...)`` that records and returns a compiled
    kernel per distinct key (as Triton would compile one)."""

    def __init__(self) -> None:
        P = SimpleNamespace
        self.params = [
            P(name="x_ptr", is_constexpr=False, do_not_specialize=False),
            P(name="n", is_constexpr=False, do_not_specialize=False),
            P(name="m", is_constexpr=False, do_not_specialize=True),
            P(name="BLOCK", is_constexpr=True, do_not_specialize=False),
        ]
        self.via_triton: list[tuple] = []
        self.compiled: list[_Compiled] = []

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.via_triton.append((tuple(grid), args, kwargs))
            self.compiled.append(_Compiled())
            return self.compiled[-1]

        return launch


@pytest.fixture
def direct(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tl_launch, "_FAST", True)
    monkeypatch.setattr(tl_launch.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tl_launch, "_current_stream", lambda device: 1234)


def test_first_call_of_a_key_goes_through_triton_then_direct(direct) -> None:  # noqa: ANN001
    fn = _StandIn()
    k = FastKernel(fn)
    buf = torch.zeros(64, dtype=torch.float16)
    k[(3,)](buf[:8], 32, 5, BLOCK=64, num_warps=4)
    assert len(fn.via_triton) == 1 and k.direct_launches == 0
    k[(7, 2)](buf[8:16], 48, 9, BLOCK=64, num_warps=4)  # same key: aligned, % 16, same constexpr
    assert len(fn.via_triton) == 1 and k.direct_launches == 1
    (call,) = fn.compiled[0].calls
    assert call[:4] == (7, 2, 1, 1234)
    assert call[4] is fn.compiled[0].function and call[5] is fn.compiled[0].packed_metadata
    assert call[6:9] == (None, None, None)
    assert call[9].data_ptr() == buf[8:16].data_ptr() and call[10:] == (48, 9, 64)
    # each of these changes Triton's specialization, so each goes through Triton again
    k[(1,)](buf[1:9], 48, 9, BLOCK=64, num_warps=4)  # misaligned pointer
    k[(1,)](buf[:8], 47, 9, BLOCK=64, num_warps=4)  # not a multiple of 16
    k[(1,)](buf[:8], 1, 9, BLOCK=64, num_warps=4)  # the value 1
    k[(1,)](buf[:8], 48, 9, BLOCK=128, num_warps=4)  # another constexpr
    k[(1,)](buf[:8], 48, 9, BLOCK=64, num_warps=8)  # another option
    assert len(fn.via_triton) == 6 and k.direct_launches == 1
    k[(1,)](buf[:8], 48, 10, BLOCK=64, num_warps=4)  # do_not_specialize: any value shares the kernel
    assert len(fn.via_triton) == 6 and k.direct_launches == 2


def test_plans_launch_their_tensors_with_the_same_keys(direct) -> None:  # noqa: ANN001
    """A plan fixes every argument but its tensors; each launch keys on those tensors' dtype and
    alignment, as a plain launch would."""
    fn = _StandIn()
    k = FastKernel(fn)
    buf = torch.zeros(64, dtype=torch.float16)
    plan = k.plan((4,), (None, 32, 5), {"BLOCK": 64, "num_warps": 4}, (0,))
    k.launch_plan(plan, (buf[:8],))  # first: through Triton
    assert len(fn.via_triton) == 1 and fn.via_triton[0][1][0].data_ptr() == buf.data_ptr()
    assert fn.via_triton[0][1][1:] == (32, 5, 64) and fn.via_triton[0][2] == {"num_warps": 4}
    k.launch_plan(plan, (buf[16:24],))  # aligned too: direct, with this tensor
    (call,) = fn.compiled[0].calls
    assert (
        call[:4] == (4, 1, 1, 1234)
        and call[9].data_ptr() == buf[16:24].data_ptr()
        and call[10:] == (32, 5, 64)
    )
    k.launch_plan(plan, (buf[1:9],))  # misaligned: through Triton again
    k.launch_plan(plan, (buf.float()[:8],))  # another dtype: through Triton again
    assert len(fn.via_triton) == 3 and k.direct_launches == 1


def test_missing_arguments_and_foreign_kinds(direct) -> None:  # noqa: ANN001
    fn = _StandIn()
    k = FastKernel(fn)
    buf = torch.zeros(8)
    with pytest.raises(TypeError, match="missing argument 'BLOCK'"):
        k[(1,)](buf, 16, 1, num_warps=4)
    k[(1,)](buf, "odd", 1, BLOCK=16)  # no key for a str: Triton decides, every time
    k[(1,)](buf, "odd", 1, BLOCK=16)
    assert len(fn.via_triton) == 2 and k.direct_launches == 0


def test_interpreter_and_switch_keep_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMLORA_TRITON_FAST_LAUNCH", "0")
    assert not tl_launch.fast_launch_enabled()
    monkeypatch.setenv("MMLORA_TRITON_FAST_LAUNCH", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not tl_launch.fast_launch_enabled()


@gpu
def test_direct_launches_equal_triton_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGMV and BGMV adds and an RMSNorm, through the direct path and through Triton, at aligned and
    misaligned inputs and inside a CUDA graph: identical bits, and the direct path was taken."""
    from mmlora.backends import get_backend
    from mmlora.forward import LoRABatchInfo, LoRAWeights
    from mmlora.layers import fused_ops as F

    assert tl_launch._FAST, "the direct path is off on this GPU (triton's launch convention changed?)"
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    S, R, in_f, offs = 4, 16, 256, (0, 256, 320, 384)
    A = (torch.randn(S, 3 * R, in_f, device=dev, generator=g) / 16).to(dt)
    B = (torch.randn(S, offs[-1], R, device=dev, generator=g) / 4).to(dt)
    weights = LoRAWeights(A, B, torch.full((S, 3), 0.5, device=dev), offs)
    w = torch.randn(in_f, device=dev, generator=g).to(dt)

    cases = []
    for name, lens, slots in (
        ("triton-sgmv", [5, 40, 3], [0, 2, -1]),
        ("triton-bgmv", [1] * 9, [0, 1, 2, 3, -1, 0, 1, 2, 3]),
    ):
        info = LoRABatchInfo(sum(lens), S, dev)
        for s in range(S):
            info.set_slot_rank(s, R)
        info.fill(lens, slots)
        cases.append((get_backend(name), info))

    def run_all(x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for backend, info in cases:
            T = info.num_tokens
            out = torch.zeros(T, offs[-1], device=dev, dtype=dt)
            backend.add_lora(out, x[:T], weights, info)
            outs.append(out)
        outs.append(F.rms_norm_triton(x[:9], w, 1e-6))
        return outs

    base = torch.randn(64 * in_f + 8, device=dev, generator=g).to(dt)
    for start in (0, 1):  # a 16-byte aligned x, then one a bf16 element off
        x = base[start : start + 48 * in_f].view(48, in_f)
        monkeypatch.setattr(tl_launch, "_FAST", False)
        want = run_all(x)
        monkeypatch.setattr(tl_launch, "_FAST", True)
        run_all(x)  # the first call of each key goes through Triton
        before = sum(k.direct_launches for k in tl_launch._WRAPPED.values())
        got = run_all(x)
        assert sum(k.direct_launches for k in tl_launch._WRAPPED.values()) >= before + 5
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    # captured and replayed with new input values
    x = base[: 48 * in_f].view(48, in_f)
    static = x.clone()
    run_all(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run_all(static)
    static.copy_(torch.randn_like(x.float()).to(dt))
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setattr(tl_launch, "_FAST", False)
    for a, b in zip(captured, run_all(static)):
        assert torch.equal(a, b)
